// The playground: the server's own API, called as any client calls it.
"use strict";

const $ = (id) => document.getElementById(id);
let config = null;

function headers(extra = {}) {
  const key = $("key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function say(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function failure(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error.message}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function load() {
  $("key").value = localStorage.getItem("accel-key") || "";
  const response = await fetch("/v1/playground", { headers: headers() });
  if (!response.ok) {
    say(`${await failure(response)}${response.status === 401 ? " (type the API key above)" : ""}`, true);
    return;
  }
  config = await response.json();
  $("model").textContent = config.model;
  const d = config.defaults;
  for (const name of ["width", "height", "steps", "frames"]) {
    if (d[name] !== undefined) $(name).value = d[name];
  }
  $("frames-field").hidden = config.output !== "video";
  $("lora-field").hidden = config.loras.length === 0;
  $("loras").replaceChildren(
    ...config.loras.map((name) => {
      const field = document.createElement("label");
      const scale = document.createElement("input");
      Object.assign(scale, { type: "number", step: "0.05", placeholder: "scale" });
      scale.dataset.lora = name;
      field.append(name, scale);
      return field;
    }),
  );
  $("picture-field").hidden = !config.picture;
  $("mask-field").hidden = !config.mask;
  $("picture").required = config.needs_picture;
  $("mask").required = config.needs_mask;
  say("ready");
}

function fields() {
  const body = { prompt: $("prompt").value };
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  if ($("negative_prompt").value) body.negative_prompt = $("negative_prompt").value;
  if (number("width") && number("height")) body.size = `${number("width")}x${number("height")}`;
  for (const name of ["steps", "seed"]) if (number(name) !== undefined) body[name] = number(name);
  if (config.output === "video" && number("frames") !== undefined) body.frames = number("frames");
  const loras = {};
  for (const scale of $("loras").querySelectorAll("input")) {
    if (scale.value !== "") loras[scale.dataset.lora] = Number(scale.value);
  }
  if (Object.keys(loras).length) body.lora = loras;
  return body;
}

function multipart(body, files) {
  const form = new FormData();
  for (const [name, value] of Object.entries(body)) {
    form.append(name, typeof value === "object" ? JSON.stringify(value) : String(value));
  }
  for (const [name, file] of Object.entries(files)) if (file) form.append(name, file);
  return form;
}

function progress(percent) {
  $("progress").hidden = percent === null;
  if (percent !== null) $("progress").value = percent;
}

async function image(body) {
  const picture = $("picture").files[0];
  const id = `pg-${Date.now()}-${Math.random().toString(36).slice(2, 10)}`;
  const request = picture
    ? fetch("/v1/images/edits", {
        method: "POST",
        headers: headers({ "X-Request-Id": id }),
        body: multipart(body, { image: picture, mask: $("mask").files[0] }),
      })
    : fetch("/v1/images/generations", {
        method: "POST",
        headers: headers({ "Content-Type": "application/json", "X-Request-Id": id }),
        body: JSON.stringify(body),
      });
  let answered = false;
  const poll = (async () => {
    while (!answered) {
      const state = await fetch(`/v1/requests/${id}`, { headers: headers() });
      if (state.ok && !answered) {
        const job = await state.json();
        progress(job.progress);
        say(`${job.status.replace("_", " ")}: ${job.progress}%`);
      }
      await new Promise((done) => setTimeout(done, 300));
    }
  })();
  const response = await request;
  answered = true;
  await poll;
  if (!response.ok) throw new Error(await failure(response));
  const result = await response.json();
  const shown = $("output");
  shown.replaceChildren(
    ...result.data.map((item) => {
      const picture = document.createElement("img");
      picture.src = `data:image/png;base64,${item.b64_json}`;
      picture.alt = `seed ${item.seed}`;
      picture.title = `seed ${item.seed}`;
      return picture;
    }),
  );
  return `done: seed ${result.data.map((item) => item.seed).join(", ")}`;
}

async function video(body) {
  const picture = $("picture").files[0];
  const created = await fetch("/v1/videos", {
    method: "POST",
    headers: headers(),
    body: multipart(body, { input_reference: picture }),
  });
  if (!created.ok) throw new Error(await failure(created));
  let job = await created.json();
  while (job.status === "queued" || job.status === "in_progress") {
    progress(job.progress || 0);
    say(`${job.status.replace("_", " ")}: ${job.progress || 0}%`);
    await new Promise((done) => setTimeout(done, 500));
    const state = await fetch(`/v1/videos/${job.id}`, { headers: headers() });
    if (!state.ok) throw new Error(await failure(state));
    job = await state.json();
  }
  if (job.status !== "completed") throw new Error(`the job ${job.status}: ${job.error ? job.error.message : ""}`);
  const content = await fetch(`/v1/videos/${job.id}/content`, { headers: headers() });
  if (!content.ok) throw new Error(await failure(content));
  const clip = document.createElement("video");
  clip.src = URL.createObjectURL(await content.blob());
  clip.controls = true;
  clip.loop = true;
  clip.autoplay = true;
  clip.muted = true;
  $("output").replaceChildren(clip);
  return `done: ${job.id}`;
}

async function generate(event) {
  event.preventDefault();
  if (config === null) await load();
  if (config === null) return;
  $("generate").disabled = true;
  progress(0);
  say("queued");
  try {
    const done = await (config.output === "video" ? video(fields()) : image(fields()));
    progress(100);
    say(done);
  } catch (error) {
    progress(null);
    say(error.message, true);
  } finally {
    $("generate").disabled = false;
  }
}

$("key").addEventListener("change", () => {
  localStorage.setItem("accel-key", $("key").value.trim());
  load();
});
$("form").addEventListener("submit", generate);
load();
