// llama.cpp's decode and prefill speed on a GGUF file (the prebuilt CPU build of the pinned
// `node-llama-cpp` 3.21.1), measured as `ember bench decode` measures ember's: a prompt of CONTEXT
// tokens evaluated first (its rate is the prefill's), then NEW greedy tokens one at a time, the
// first one excluded (it closes the prompt), each step's time from token to token.
//
//     EMBER_NODE_MODULES=target/node/node_modules node experiments/llama_cpp_speed.mjs MODEL.gguf THREADS CONTEXT NEW
//
// Prints one JSON object: {"threads", "context", "new_tokens", "prefill_tokens_per_s",
// "decode_ms_per_token", "decode_tokens_per_s"}. experiments/decode_vs_llama_cpp.sh alternates it
// with ember on the same file and threads.
import { join, resolve } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.env.EMBER_NODE_MODULES;
if (!modules) {
    console.error("EMBER_NODE_MODULES must name the node_modules folder that holds node-llama-cpp");
    process.exit(2);
}
const { getLlama } = await import(pathToFileURL(resolve(join(modules, "node-llama-cpp", "dist", "index.js"))).href);

const [modelPath, threadsArg, contextArg, newArg] = process.argv.slice(2);
const [threads, contextLen, newTokens] = [Number(threadsArg), Number(contextArg), Number(newArg)];
if (!modelPath || !(threads > 0) || !(contextLen > 0) || !(newTokens > 1)) {
    console.error("usage: llama_cpp_speed.mjs MODEL.gguf THREADS CONTEXT NEW (NEW > 1)");
    process.exit(2);
}
const llama = await getLlama({ gpu: false, build: "never", logLevel: "error", maxThreads: threads });
const model = await llama.loadModel({ modelPath });
const context = await model.createContext({
    contextSize: contextLen + newTokens + 8,
    sequences: 1,
    threads,
    batchSize: Math.max(contextLen, 1),
});
const sequence = context.getSequence();
// A prompt of ordinary text tokens, as long as asked (ember's bench feeds token ids likewise).
const text = "The quick brown fox jumps over the lazy dog while the river runs to the sea. ";
let prompt = [];
while (prompt.length < contextLen) prompt = prompt.concat(Array.from(model.tokenize(text)));
prompt = prompt.slice(0, contextLen);

const t0 = performance.now();
await sequence.evaluateWithoutGeneratingNewTokens(prompt.slice(0, -1));
const prefillS = (performance.now() - t0) / 1000;

const times = [];
let last = null;
for await (const token of sequence.evaluate(prompt.slice(-1), { temperature: 0 })) {
    const now = performance.now();
    if (last !== null) times.push(now - last);
    last = now;
    void token;
    if (times.length >= newTokens - 1) break;
}
times.sort((a, b) => a - b);
const median = times[Math.floor(times.length / 2)];
const mean = times.reduce((a, b) => a + b, 0) / times.length;
console.log(JSON.stringify({
    threads,
    context: contextLen,
    new_tokens: newTokens,
    prefill_tokens_per_s: (prompt.length - 1) / prefillS,
    decode_ms_per_token: mean,
    decode_median_ms: median,
    decode_tokens_per_s: 1000 / mean,
}));
await context.dispose();
await model.dispose();
await llama.dispose();
