// llama.cpp itself (the prebuilt CPU build in the `node-llama-cpp` package, pinned 3.21.1) runs a GGUF
// file: the prompt's ids as llama.cpp tokenizes them (with the file's BOS where its metadata asks for
// one) and the greedy ids after them. tests/gguf.rs
// runs this on ember's exports.
//
//     EMBER_NODE_MODULES=target/node/node_modules node tests/llama_cpp_greedy.mjs MODEL.gguf N PROMPT...
//
// Prints one JSON object: {"runs": [{"prompt", "prompt_ids", "ids", "text"}]}; a generation stops at
// an end-of-generation token or after N tokens.
import { join, resolve } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.env.EMBER_NODE_MODULES;
if (!modules) {
    console.error("EMBER_NODE_MODULES must name the node_modules folder that holds node-llama-cpp");
    process.exit(2);
}
const { getLlama } = await import(pathToFileURL(resolve(join(modules, "node-llama-cpp", "dist", "index.js"))).href);

const [modelPath, count, ...prompts] = process.argv.slice(2);
const n = Number(count);
// The threads named: left to its default, node-llama-cpp ran 80 times slower on a 2-core
// machine (3.4 minutes for two 32-token continuations instead of 2.6 s).
const threads = (await import("node:os")).availableParallelism();
const llama = await getLlama({ gpu: false, build: "never", logLevel: "error", maxThreads: threads });
const model = await llama.loadModel({ modelPath });
const runs = [];
for (const prompt of prompts) {
    const context = await model.createContext({ contextSize: 256, sequences: 1, threads });
    const sequence = context.getSequence();
    // As llama.cpp's own tools tokenize a prompt: special tokens' text parsed (a rendered chat
    // template's), the file's BOS first where it says so, once.
    const promptIds = Array.from(model.tokenize(prompt, true));
    const bos = model.tokens.bos;
    if (model.tokens.shouldPrependBosToken && bos != null && promptIds[0] !== bos) promptIds.unshift(bos);
    const ids = [];
    if (n > 0) {
        for await (const token of sequence.evaluate(promptIds, { temperature: 0 })) {
            if (model.isEogToken(token)) break;
            ids.push(token);
            if (ids.length >= n) break;
        }
    }
    runs.push({ prompt, prompt_ids: promptIds, ids, text: model.detokenize(ids) });
    await context.dispose();
}
console.log(JSON.stringify({ runs }));
await model.dispose();
await llama.dispose();
