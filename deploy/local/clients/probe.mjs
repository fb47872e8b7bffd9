// One family of third-party Node clients against the gateway:
//   node probe.mjs <openai-node|anthropic-node|vercel-ai> <base> <model>
// run by deploy.local.client_matrix from a folder whose node_modules hold the clients. Prints
// one line per API tried: "ok|FAIL <client> <version> <api> <detail>" (tab-separated). The
// tiny test model writes gibberish: a probe checks the shape of the answer, not its meaning.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { join } from "node:path";

const require = createRequire(process.cwd() + "/");
const [client, base, model] = process.argv.slice(2);
const QUESTION = "Say hello.";

function version(pkg) {
  try {
    // read the file itself: packages with "exports" do not expose their package.json
    return JSON.parse(readFileSync(join(process.cwd(), "node_modules", pkg, "package.json"))).version;
  } catch {
    return "-";
  }
}

async function report(name, pkg, api, fn) {
  try {
    const detail = await fn();
    console.log(["ok", name, version(pkg), api, JSON.stringify(String(detail)).slice(0, 120)].join("\t"));
  } catch (err) {
    console.log(["FAIL", name, version(pkg), api, String(err).slice(0, 300)].join("\t"));
  }
}

async function openaiNode() {
  const { default: OpenAI } = await import(require.resolve("openai"));
  const c = new OpenAI({ baseURL: base + "/v1", apiKey: "unused" });
  await report("openai-node", "openai", "chat", async () => {
    const r = await c.chat.completions.create({ model, messages: [{ role: "user", content: QUESTION }], max_tokens: 8 });
    return r.choices[0].message.content;
  });
  await report("openai-node", "openai", "responses", async () => {
    const r = await c.responses.create({ model, input: QUESTION, max_output_tokens: 8 });
    if (!r.usage || r.usage.output_tokens < 1) throw new Error("no usage");
    return r.output_text;
  });
  await report("openai-node", "openai", "responses stream", async () => {
    const s = c.responses.stream({ model, input: QUESTION, max_output_tokens: 8 });
    for await (const _ of s) { /* read every event */ }
    return (await s.finalResponse()).output_text;
  });
}

async function anthropicNode() {
  const { default: Anthropic } = await import(require.resolve("@anthropic-ai/sdk"));
  const c = new Anthropic({ baseURL: base, apiKey: "unused" });
  const messages = [{ role: "user", content: QUESTION }];
  await report("anthropic-node", "@anthropic-ai/sdk", "messages", async () => {
    const m = await c.messages.create({ model, max_tokens: 8, messages });
    return m.content.map((b) => b.text || "").join("");
  });
  await report("anthropic-node", "@anthropic-ai/sdk", "messages stream", async () => {
    const s = c.messages.stream({ model, max_tokens: 8, messages });
    return (await s.finalMessage()).stop_reason;
  });
}

async function vercelAi() {
  const { generateText, streamText } = await import(require.resolve("ai"));
  const { createOpenAI } = await import(require.resolve("@ai-sdk/openai"));
  const { createAnthropic } = await import(require.resolve("@ai-sdk/anthropic"));
  const openai = createOpenAI({ baseURL: base + "/v1", apiKey: "unused" });
  await report("vercel-ai", "ai", "openai(model): responses", async () => {
    const r = await generateText({ model: openai(model), prompt: QUESTION, maxOutputTokens: 8 });
    return `${r.finishReason} ${r.usage.outputTokens}`;
  });
  await report("vercel-ai", "ai", "openai(model): responses stream", async () => {
    const r = streamText({ model: openai(model), prompt: QUESTION, maxOutputTokens: 8 });
    let text = "";
    for await (const t of r.textStream) text += t;
    return `${await r.finishReason} ${text.length}`;
  });
  await report("vercel-ai", "ai", "openai.chat(model)", async () => {
    const r = await generateText({ model: openai.chat(model), prompt: QUESTION, maxOutputTokens: 8 });
    return r.finishReason;
  });
  const anthropic = createAnthropic({ baseURL: base + "/v1", apiKey: "unused" });
  await report("vercel-ai", "@ai-sdk/anthropic", "anthropic(model): messages", async () => {
    const r = await generateText({ model: anthropic(model), prompt: QUESTION, maxOutputTokens: 8 });
    return r.finishReason;
  });
}

const probes = { "openai-node": openaiNode, "anthropic-node": anthropicNode, "vercel-ai": vercelAi };
await probes[client]();
