"""Run by test_vllm_folders.py in its own process (tritonclient's `inference.*` messages cannot share a
process with Ferry's): the requests Triton's vLLM sample client (vllm_backend samples/client.py) sends,
the same way: tritonclient.grpc.aio `stream_infer` fed by an async iterator of request dicts, each with
`text_input`, `stream`, `sampling_parameters` (JSON), `exclude_input_in_output`, the same sampling
parameters as request parameters, requested output `text_output` and a numeric request id.

argv: url, then a JSON object {"model", "prompts", "sampling", "stream", "exclude"}; prints
{"texts": {request id: [text_output of each response]}, "errors": [...]}.
"""

import asyncio
import json
import sys

import numpy as np
import tritonclient.grpc.aio as grpcclient


def sample_request(model: str, prompt: str, stream: bool, request_id: int, sampling: dict, exclude: bool) -> dict:
    tensors = []
    for name, datatype, value in (("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_)),
                                  ("stream", "BOOL", np.array([stream], dtype=bool)),
                                  ("sampling_parameters", "BYTES",
                                   np.array([json.dumps(sampling).encode()], dtype=np.object_)),
                                  ("exclude_input_in_output", "BOOL", np.array([exclude], dtype=bool))):
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    return {"model_name": model, "inputs": tensors, "outputs": [grpcclient.InferRequestedOutput("text_output")],
            "request_id": str(request_id), "parameters": sampling}


async def main(url: str, call: dict) -> dict:
    texts = {str(i): [] for i in range(len(call["prompts"]))}
    errors = []

    async def requests():
        for i, prompt in enumerate(call["prompts"]):
            yield sample_request(call["model"], prompt, call["stream"], i, call["sampling"], call["exclude"])

    async with grpcclient.InferenceServerClient(url) as client:
        async for result, error in client.stream_infer(inputs_iterator=requests()):
            if error is not None:
                errors.append(str(error))
            else:
                texts[result.get_response().id] += [t.decode() for t in result.as_numpy("text_output")]
    return {"texts": texts, "errors": errors}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))))
