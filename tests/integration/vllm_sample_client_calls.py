"""Triton's vLLM sample client (vllm_backend samples/client.py), its requests as it builds them, run in a
subprocess (tritonclient's protobufs cannot share a process with Ferry's). Prints JSON: texts by id, errors.

usage: vllm_sample_client_calls.py ADDRESS STREAMING EXCLUDE SAMPLING_JSON PROMPTS_JSON
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import tritonclient.grpc.aio as grpcclient

def create_request(prompt, stream, request_id, sampling_parameters, exclude_input_in_output):
    """samples/client.py's create_request, as it builds each request (send_parameters_as_tensor=True)."""
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES")]
    inputs[-1].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
    inputs.append(grpcclient.InferInput("stream", [1], "BOOL"))
    inputs[-1].set_data_from_numpy(np.array([stream], dtype=bool))
    inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
    inputs[-1].set_data_from_numpy(np.array([json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_))
    inputs.append(grpcclient.InferInput("exclude_input_in_output", [1], "BOOL"))
    inputs[-1].set_data_from_numpy(np.array([exclude_input_in_output], dtype=bool))
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    return {"model_name": "vllm_model", "inputs": inputs, "outputs": outputs, "request_id": str(request_id),
            "parameters": sampling_parameters}


def run_client(address: str, streaming: bool, exclude: bool, sampling: dict, prompts: list[str]):
    """The client's process_stream: one stream, every prompt; returns (texts by id, errors)."""

    async def requests():
        for i, prompt in enumerate(prompts):
            yield create_request(prompt, streaming, i, sampling, exclude)

    async def main():
        client = grpcclient.InferenceServerClient(url=address)
        texts, errors = {str(i): [] for i in range(len(prompts))}, []
        try:
            async for result, error in client.stream_infer(inputs_iterator=requests(), stream_timeout=120):
                if error:
                    errors.append(str(error))
                else:
                    texts[result.get_response().id] += [t.decode() for t in result.as_numpy("text_output")]
        finally:
            await client.close()
        return {k: "".join(v) for k, v in texts.items()}, errors

    return asyncio.run(main())


if __name__ == "__main__":
    texts, errors = run_client(sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", json.loads(sys.argv[4]),
                               json.loads(sys.argv[5]))
    print(json.dumps({"texts": texts, "errors": errors}))
