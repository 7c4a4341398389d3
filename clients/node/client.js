#!/usr/bin/env node
// Ferry from Node.js: @grpc/grpc-js with stubs loaded at run time from the repository's protos/.
//
//   node client.js [--url HOST:PORT] infer MODEL
//       reads the model's metadata, sends input k filled with (k + 1) * [0, 1, 2, ...] as raw
//       little-endian bytes, prints the outputs as JSON
//   node client.js [--url HOST:PORT] generate MODEL PROMPT [--max-tokens N]
//       streams the text to stdout as it arrives, then prints a JSON summary line to stderr
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const ROOT = path.resolve(__dirname, "..", "..");
const definition = protoLoader.loadSync(["protos/grpc_service.proto", "protos/generate.proto"], {
  includeDirs: [ROOT], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
});
const proto = grpc.loadPackageDefinition(definition);

// KServe v2 datatype -> [bytes per element, Buffer writer, Buffer reader]
const TYPES = {
  FP32: [4, "writeFloatLE", "readFloatLE"],
  FP64: [8, "writeDoubleLE", "readDoubleLE"],
  INT32: [4, "writeInt32LE", "readInt32LE"],
  INT64: [8, "writeBigInt64LE", "readBigInt64LE"],
};

function toRaw(datatype, values) {
  const [size, write] = TYPES[datatype];
  const buf = Buffer.alloc(values.length * size);
  values.forEach((v, i) => buf[write](datatype === "INT64" ? BigInt(v) : v, i * size));
  return buf;
}

function fromRaw(datatype, buf) {
  const [size, , read] = TYPES[datatype];
  const out = [];
  for (let offset = 0; offset < buf.length; offset += size) out.push(Number(buf[read](offset)));
  return out;
}

function call(client, method, request) {
  return new Promise((resolve, reject) =>
    client[method](request, (err, response) => (err ? reject(err) : resolve(response))));
}

async function infer(url, model) {
  const client = new proto.inference.GRPCInferenceService(url, grpc.credentials.createInsecure());
  const meta = await call(client, "ModelMetadata", { name: model });
  const request = { model_name: model, inputs: [], raw_input_contents: [] };
  meta.inputs.forEach((input, k) => {
    if (!TYPES[input.datatype]) throw new Error(`input ${input.name}: ${input.datatype} is not in this example`);
    const shape = input.shape.map((d) => (d < 0 ? 1 : d));
    const count = shape.reduce((a, b) => a * b, 1);
    request.inputs.push({ name: input.name, datatype: input.datatype, shape });
    request.raw_input_contents.push(toRaw(input.datatype, Array.from({ length: count }, (_, i) => (k + 1) * i)));
  });
  const response = await call(client, "ModelInfer", request);
  const outputs = {};
  response.outputs.forEach((out, i) => {
    outputs[out.name] = { datatype: out.datatype, shape: out.shape, data: fromRaw(out.datatype, response.raw_output_contents[i]) };
  });
  console.log(JSON.stringify({ model: response.model_name, outputs }));
  client.close();
}

function generate(url, model, prompt, maxTokens) {
  const client = new proto.ferry.generate.v1.Generation(url, grpc.credentials.createInsecure());
  const stream = client.Generate({ model_name: model, text: prompt, sampling: { max_tokens: maxTokens } });
  const tokenIds = [];
  let last = null;
  stream.on("data", (response) => {
    process.stdout.write(response.text);
    tokenIds.push(...response.token_ids);
    if (response.finish_reason) last = response;
  });
  return new Promise((resolve, reject) => {
    stream.on("error", reject);
    stream.on("end", () => {
      process.stdout.write("\n");
      console.error(JSON.stringify({
        finish_reason: last && last.finish_reason, usage: last && last.usage, token_ids: tokenIds,
      }));
      client.close();
      resolve();
    });
  });
}

async function main(argv) {
  let url = "127.0.0.1:8001";
  let maxTokens = 0;
  const rest = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--url") url = argv[++i];
    else if (argv[i] === "--max-tokens") maxTokens = Number(argv[++i]);
    else rest.push(argv[i]);
  }
  const [command, model, prompt] = rest;
  if (command === "infer" && model) return infer(url, model);
  if (command === "generate" && model && prompt !== undefined) return generate(url, model, prompt, maxTokens);
  console.error("usage: node client.js [--url HOST:PORT] infer MODEL | generate MODEL PROMPT [--max-tokens N]");
  process.exitCode = 2;
}

main(process.argv.slice(2)).catch((err) => {
  const status = err.code !== undefined ? `${grpc.status[err.code]}: ${err.details}` : err.message;
  console.error(`error: ${status}`);
  process.exitCode = 1;
});
