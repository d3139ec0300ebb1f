/* The diffgraph playground: a form over POST /v1/images/generations ("stream": true), or with an image (and a
 * mask painted over it) POST /v1/images/edits (multipart, "stream": "true"), read as server-sent
 * events through fetch() (EventSource cannot POST); one card per request with a live progress bar; a history in
 * localStorage; a status panel polled from /status. No dependencies, no build step.
 *
 * Reads GET /info (the model, its defaults, what a request may ask for) until the engine is ready. With API keys
 * (/info says auth_required) the key is asked for once, kept in sessionStorage and sent as `Authorization: Bearer`;
 * a 401 asks again. API errors are shown next to the form field their `param` names.
 *
 * The model picker (models.js, over GET /v1/models) chooses a request's `model` when the server serves several
 * (--model-dir); the default is sent as no field. Its choice is kept in the history like the other settings.
 */
"use strict";

(() => {
  const KEY_STORAGE = "diffgraph.apiKey";
  const HISTORY_STORAGE = "diffgraph.history.v1";
  const HISTORY_CAP = 50;
  const STATUS_EVERY_MS = 2000;
  const INFO_EVERY_MS = 1000;
  const THUMB_PX = 96;
  // the body field an API error names -> the form field that edits it
  const FIELD_FOR_PARAM = {
    prompt: "prompt", negative_prompt: "negative-prompt", size: "size", n: "n", num_inference_steps: "steps",
    guidance_scale: "guidance", seed: "seed", sampler: "sampler", schedule: "schedule",
    image: "image", mask: "image", strength: "strength", loras: "lora", prompt_syntax: "prompt-syntax",
    model: "model", controls: "control-model", image_prompts: "ip-model", reference_images: "ref-images-input",
  };
  const FIELDS = ["model", "prompt", "negative-prompt", "prompt-syntax", "size", "steps", "guidance", "sampler",
    "schedule", "seed", "n", "image", "strength", "lora", "control-model", "ip-model", "ref-images-input"];
  const AUTO_SIZE = "auto";  // an edit's size: the image's, rounded down to multiples of 8 (the server's rule)
  const EXTENSIONS = { png: "png", jpeg: "jpg", webp: "webp" };

  const $ = (id) => document.getElementById(id);
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  const app = {
    info: null,
    history: [],
    nextLocalId: 1,
    edit: { file: null, width: 0, height: 0, painted: false, drawing: false },  // the image of an edit
    keyPrompt: null,   // the pending askForKey promise, shared by whoever needs a key meanwhile
    askedKeyOnLoad: false,
    picker: null,      // the model picker (models.js)
  };

  // -- small helpers --------------------------------------------------------------------------------
  function el(tag, props = {}, children = []) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props)) {
      if (name === "text") node.textContent = value;
      else if (name === "class") node.className = value;
      else if (name === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(name, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  function formatMs(ms) {
    if (ms === null || ms === undefined || !Number.isFinite(Number(ms))) return "—";
    const v = Number(ms);
    return v < 1000 ? `${Math.round(v)} ms` : `${(v / 1000).toFixed(2)} s`;
  }

  function slug(text) {
    const s = String(text).toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-+|-+$/g, "");
    return s.slice(0, 40).replace(/-+$/, "") || "image";
  }

  function summary(s) {
    const parts = [s.size === AUTO_SIZE ? "the image's size" : s.size, `${s.steps} steps`, `${s.sampler}/${s.schedule}`];
    if (s.edit) parts.unshift(s.strength ? `${s.edit} (strength ${s.strength})` : s.edit);
    if (s.lora) parts.push(`${s.lora} ×${s.lora_scale}`);
    if (s.control) parts.push(`control ${s.control.model} ×${s.control.scale}`);
    if (s.image_prompts) parts.push(`image prompt ${s.image_prompts.model} ×${s.image_prompts.scale}`);
    if (s.references) parts.push(`${s.references} reference image${s.references > 1 ? "s" : ""}`);
    if (s.guidance !== "") parts.push(`cfg ${s.guidance}`);
    if (Number(s.n) > 1) parts.push(`${s.n} images`);
    if (s.model && app.picker && app.picker.several()) parts.unshift(s.model);
    return parts.join(" · ");
  }

  // -- the API key ----------------------------------------------------------------------------------
  function storedKey() {
    try { return sessionStorage.getItem(KEY_STORAGE) || ""; } catch (e) { return ""; }
  }

  function storeKey(key) {
    try {
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
      else sessionStorage.removeItem(KEY_STORAGE);
    } catch (e) { /* storage disabled: the key lives for this page only */ }
    app.memoryKey = key;
  }

  function currentKey() { return storedKey() || app.memoryKey || ""; }

  function authHeaders(extra = {}) {
    const key = currentKey();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
  }

  /* Opens the key dialog; resolves to the accepted key, or null when the user cancels. The key is checked
   * against GET /v1/models (a /v1 route, so it needs the key) before it is kept. */
  function askForKey(reason) {
    if (app.keyPrompt) return app.keyPrompt;
    const dialog = $("key-dialog");
    const input = $("api-key");
    const error = $("key-error");
    $("key-reason").textContent = reason;
    error.textContent = "";
    input.value = "";
    app.keyPrompt = new Promise((resolve) => {
      const finish = (key) => {
        $("key-form").removeEventListener("submit", onSubmit);
        $("api-key-cancel").removeEventListener("click", onCancel);
        dialog.removeEventListener("cancel", onCancel);
        if (dialog.open) dialog.close();
        app.keyPrompt = null;
        resolve(key);
      };
      const onSubmit = async (event) => {
        event.preventDefault();
        const key = input.value.trim();
        if (!key) { error.textContent = "Enter the key the server was started with."; return; }
        error.textContent = "checking…";
        let status = 0;
        try {
          const r = await fetch("/v1/models", { headers: { Authorization: `Bearer ${key}` }, cache: "no-store" });
          status = r.status;
        } catch (e) { status = -1; }  // unreachable now: keep the key; a request will tell
        if (status === 401) {
          error.textContent = "The server did not accept this key.";
          input.select();
          return;
        }
        storeKey(key);
        loadLoras();
        app.controls.load();
        app.imagePrompt.load();
        app.picker.refresh();
        finish(key);
      };
      const onCancel = (event) => { event.preventDefault(); finish(null); };
      $("key-form").addEventListener("submit", onSubmit);
      $("api-key-cancel").addEventListener("click", onCancel);
      dialog.addEventListener("cancel", onCancel);
      dialog.showModal();
      input.focus();
    });
    return app.keyPrompt;
  }

  // -- /info: the form's choices and defaults --------------------------------------------------------
  function round8(x) { return Math.round(x / 8) * 8; }

  function sizeChoices(info) {
    const graphed = (info.graphed_resolutions || []).slice();
    const n = info.native_size;
    // the native square, 3:2 both ways and twice the side: 512 -> 512x512, 768x512, 512x768, 1024x1024
    const common = n
      ? [[n, n], [round8(n * 1.5), n], [n, round8(n * 1.5)], [2 * n, 2 * n]].map(([w, h]) => `${w}x${h}`)
      : ["512x512", "768x512", "512x768", "1024x1024"];
    const others = common.filter((s) => !graphed.includes(s)).filter((s) => {
      const [w, h] = s.split("x").map(Number);
      return w >= 64 && h >= 64 && w <= 2048 && h <= 2048;
    });
    return { graphed, others: [...new Set(others)] };
  }

  /* Replaces a select's options; keeps the user's choice when it is still offered, else the first option. */
  function fillSelect(select, groups) {
    const previous = select.dataset.touched ? select.value : "";
    select.replaceChildren();
    for (const [label, values] of groups) {
      if (!values.length) continue;
      const parent = label ? el("optgroup", { label }) : select;
      for (const v of values) parent.append(el("option", { value: v, text: v }));
      if (label) select.append(parent);
    }
    const values = Array.from(select.options).map((o) => o.value);
    if (previous && values.includes(previous)) select.value = previous;
  }

  /* The size choices of the chosen model: /info's, or for another model of a different native size, its own
   * (the graphed ones too when the server graphs each model's native size: no --resolutions). */
  function sizeSource(model) {
    const info = app.info;
    if (!info || !model || model.id === info.model || !model.native_size || model.native_size === info.native_size) {
      return info;
    }
    const square = (n) => `${n}x${n}`;
    const graphed = info.graphed_resolutions || [];
    const nativeOnly = graphed.length === 1 && graphed[0] === square(info.native_size);
    return { native_size: model.native_size, graphed_resolutions: nativeOnly ? [square(model.native_size)] : graphed };
  }

  function fillSizes(source) {
    const select = $("size");
    const wasAuto = select.value === AUTO_SIZE;
    const sizes = sizeChoices(source);
    fillSelect(select, [["graphed", sizes.graphed], ["other sizes", sizes.others], ["", ["custom"]]]);
    const custom = select.querySelector('option[value="custom"]');
    if (custom) custom.textContent = "custom…";
    if (app.edit.file) {
      addAutoSize();
      if (wasAuto) select.value = AUTO_SIZE;
    }
    syncCustomSize();
  }

  /* The chosen model or its listing changed: its sizes, unless /info has not answered yet. */
  function onModel(model) {
    if (app.info && app.info.ready) fillSizes(sizeSource(model));
    renderHistory();  // the summaries name the model once there are several
  }

  function applyInfo(info) {
    const becameReady = info.ready && !(app.info && app.info.ready);
    app.info = info;
    fillSizes(sizeSource(app.picker.find(app.picker.chosen())));
    fillSelect($("sampler"), [["", info.samplers || []]]);
    fillSelect($("schedule"), [["", info.schedules || []]]);
    app.references.show(info);

    const steps = $("steps");
    const n = $("n");
    if (info.max_steps) steps.max = info.max_steps;
    if (info.max_images) {
      n.max = info.max_images;
      document.querySelector('label[for="n"]').textContent = `Images (1–${info.max_images})`;
    }
    if (!steps.dataset.touched && info.default_steps) steps.value = info.default_steps;
    if (!$("guidance").dataset.touched && info.default_guidance !== null && info.default_guidance !== undefined) {
      $("guidance").value = info.default_guidance;
    }

    const bits = [info.model];
    if (info.ready) {
      bits.push(info.family, `${info.mode} mode`);
      if (info.native_size) bits.push(`native ${info.native_size}x${info.native_size}`);
    } else {
      bits.push("loading the model…");
    }
    $("model-line").textContent = bits.filter(Boolean).join(" · ");
    $("model-line").dataset.ready = info.ready ? "true" : "false";
    $("generate").disabled = !info.ready;
    $("generate-hint").textContent = info.ready ? "" : "waiting for the model…";
    $("api-key-button").hidden = !info.auth_required;
    if (becameReady) {
      document.body.dataset.ready = "true";
      loadLoras();
      app.controls.load();
      app.imagePrompt.load();
      app.picker.refresh();
    }

    if (info.auth_required && !currentKey() && !app.askedKeyOnLoad) {
      app.askedKeyOnLoad = true;
      askForKey("This server needs an API key.");
    }
  }

  async function loadInfo() {
    for (;;) {
      try {
        const r = await fetch("/info", { cache: "no-store" });
        if (r.ok) {
          const info = await r.json();
          applyInfo(info);
          if (info.ready) return;
        } else {
          $("model-line").textContent = `GET /info answered ${r.status}; retrying…`;
        }
      } catch (e) {
        $("model-line").textContent = "cannot reach the server; retrying…";
      }
      await sleep(INFO_EVERY_MS);
    }
  }

  // -- the form ---------------------------------------------------------------------------------------
  function syncCustomSize() {
    const custom = $("size").value === "custom";
    $("size-custom").hidden = !custom;
  }

  function currentSize() {
    return $("size").value === "custom" ? $("size-custom").value.trim() : $("size").value;
  }

  function readForm() {
    return {
      model: app.picker.chosen() || (app.info && app.info.model) || "",
      prompt: $("prompt").value,
      negative_prompt: $("negative-prompt").value,
      syntax: $("prompt-syntax").value,
      size: currentSize(),
      steps: $("steps").value.trim(),
      guidance: $("guidance").value.trim(),
      sampler: $("sampler").value,
      schedule: $("schedule").value,
      seed: $("seed").value.trim(),
      n: $("n").value.trim(),
      strength: $("strength").value.trim(),
      edit: app.edit.file ? (app.edit.painted ? "inpainting" : "image-to-image") : "",
      lora: $("lora").value,
      lora_scale: $("lora-scale").value.trim(),
      control: app.controls.settings(),  // without its image (the history keeps settings only)
      image_prompts: app.imagePrompt.settings(),
      references: app.references.count(),  // how many (the history keeps settings only)
    };
  }

  /* The adapters the server serves (GET /v1/loras) in the adapter picker; the picker stays hidden without any. */
  async function loadLoras() {
    let listing = null;
    try {
      const r = await fetch("/v1/loras", { headers: authHeaders(), cache: "no-store" });
      if (r.ok) listing = await r.json();
    } catch (e) { /* the picker stays hidden */ }
    const names = listing ? listing.data.map((a) => a.name) : [];
    const select = $("lora");
    const chosen = select.value;
    select.replaceChildren(el("option", { value: "", text: "none" }),
      ...names.map((name) => el("option", { value: name, text: name })));
    if (names.includes(chosen)) select.value = chosen;
    $("adapters").hidden = names.length === 0;
  }

  function fillForm(s) {
    app.picker.restore(s.model || "");
    $("prompt").value = s.prompt || "";
    $("negative-prompt").value = s.negative_prompt || "";
    $("prompt-syntax").value = s.syntax || "";
    const sizes = Array.from($("size").options).map((o) => o.value);
    if (s.size && sizes.includes(s.size) && s.size !== "custom") {
      $("size").value = s.size;
      $("size-custom").value = "";
    } else {
      $("size").value = "custom";
      $("size-custom").value = s.size || "";
    }
    syncCustomSize();
    $("steps").value = s.steps;
    $("guidance").value = s.guidance;
    for (const name of ["sampler", "schedule"]) {
      const values = Array.from($(name).options).map((o) => o.value);
      if (values.includes(s[name])) $(name).value = s[name];
    }
    $("seed").value = s.seed || "";
    $("n").value = s.n || 1;
    $("strength").value = s.strength || "";
    const adapters = Array.from($("lora").options).map((o) => o.value);
    $("lora").value = s.lora && adapters.includes(s.lora) ? s.lora : "";
    $("lora-scale").value = s.lora_scale || "1";
    app.controls.restore(s.control);
    app.imagePrompt.restore(s.image_prompts);
    for (const id of ["size", "steps", "guidance", "sampler", "schedule"]) $(id).dataset.touched = "true";
    clearErrors();
  }

  function clearErrors() {
    for (const id of FIELDS) clearFieldError(id);
    $("error-general").textContent = "";
  }

  function clearFieldError(id) {
    $(`error-${id}`).textContent = "";
    $(id).removeAttribute("aria-invalid");
    if (id === "size") $("size-custom").removeAttribute("aria-invalid");
  }

  /* Shows `message` at the field that edits body field `param`, or near the Generate button. */
  function showError(param, message) {
    const field = FIELD_FOR_PARAM[param] || (param && param.startsWith("controls") ? "control-model"
      : param && param.startsWith("image_prompts") ? "ip-model"
        : param && param.startsWith("reference_images") ? "ref-images-input" : undefined);
    if (!field || $(field).closest("[hidden]")) {  // a field not shown (one model: no picker) says it near Generate
      $("error-general").textContent = message;
      return;
    }
    $(`error-${field}`).textContent = message;
    $(field).setAttribute("aria-invalid", "true");
    if (field === "size" && !$("size-custom").hidden) $("size-custom").setAttribute("aria-invalid", "true");
  }

  /* Checks only what the server cannot be asked about (form syntax); ranges are the server's to check. */
  function localErrors(s) {
    const errors = [];
    if (!s.prompt.trim()) errors.push(["prompt", "Enter a prompt: describe the image to generate."]);
    if (!(s.edit && s.size === AUTO_SIZE) && !/^\s*\d+\s*[xX×]\s*\d+\s*$/.test(s.size)) {
      errors.push(["size", "Enter the size as WIDTHxHEIGHT, e.g. 512x512."]);
    }
    if (!/^\d+$/.test(s.steps)) errors.push(["num_inference_steps", "Enter the number of steps, a whole number."]);
    if (s.guidance !== "" && !Number.isFinite(Number(s.guidance))) {
      errors.push(["guidance_scale", "Enter guidance as a number, e.g. 7.5."]);
    }
    if (s.seed !== "" && !/^\d+$/.test(s.seed)) {
      errors.push(["seed", "A seed is a whole number >= 0; leave it empty for a random one."]);
    }
    if (!/^\d+$/.test(s.n)) errors.push(["n", "Enter the number of images, a whole number."]);
    if (s.edit && s.strength !== "" && !Number.isFinite(Number(s.strength))) {
      errors.push(["strength", "Enter the strength as a number in (0, 1], e.g. 0.8, or leave it empty."]);
    }
    if (s.lora && (s.lora_scale === "" || !Number.isFinite(Number(s.lora_scale)))) {
      errors.push(["loras", "Enter the adapter's scale as a number, e.g. 0.8 (from -8 to 8)."]);
    }
    return errors.concat(app.controls.localErrors(), app.imagePrompt.localErrors(),
      app.references.localErrors(Boolean(s.edit)));
  }

  /* The model a request names: none for the default (the server's own choice; a one-model server takes no other). */
  function sentModel(s) {
    return s.model && s.model !== app.picker.defaultId() && !(app.info && s.model === app.info.model) ? s.model : "";
  }

  /* The JSON body. The seed goes in as its digits: seeds reach 2**63 - 1, beyond a JS number's exact range. */
  function requestBody(s, control, imagePrompt, references) {
    const body = {
      prompt: s.prompt, size: s.size.replace(/\s+/g, "").replace("×", "x").toLowerCase(), n: Number(s.n),
      num_inference_steps: Number(s.steps), sampler: s.sampler, schedule: s.schedule,
      output_format: "png", response_format: "b64_json", stream: true,
      // a live preview about every tenth of the way (the server renders them for this request's rows only)
      preview: { every: Math.max(1, Math.round(Number(s.steps) / 10)), format: "jpeg" },
    };
    if (sentModel(s)) body.model = s.model;
    if (s.negative_prompt.trim()) body.negative_prompt = s.negative_prompt;
    if (s.syntax) body.prompt_syntax = s.syntax;
    if (s.guidance !== "") body.guidance_scale = Number(s.guidance);
    if (s.lora) body.loras = [{ name: s.lora, scale: Number(s.lora_scale) }];
    if (control) body.controls = [control];
    if (imagePrompt) body.image_prompts = imagePrompt;
    if (references) body.reference_images = references;
    let json = JSON.stringify(body);
    if (s.seed !== "") json = `${json.slice(0, -1)},"seed":${BigInt(s.seed).toString()}}`;
    return json;
  }

  async function onGenerate(event) {
    event.preventDefault();
    clearErrors();
    const settings = readForm();
    const errors = localErrors(settings);
    if (errors.length) {
      for (const [param, message] of errors) showError(param, message);
      const first = FIELD_FOR_PARAM[errors[0][0]];
      if (first) (first === "size" && !$("size-custom").hidden ? $("size-custom") : $(first)).focus();
      return;
    }
    if (app.info && app.info.auth_required && !currentKey()) {
      const key = await askForKey("This server needs an API key.");
      if (!key) { showError(null, "This server needs an API key: generation was not started."); return; }
    }
    const edit = app.edit.file ? { file: app.edit.file, mask: app.edit.painted ? await maskBlob() : null } : null;
    if (edit) {
      Object.assign(edit, { control: app.controls.forForm(), imagePrompt: app.imagePrompt.forForm(),
        references: app.references.forForm() });
    }
    startRequest(settings, edit, edit ? null : await app.controls.forBody(), edit ? null : app.imagePrompt.forBody(),
      edit ? null : app.references.forBody());
  }

  /* The multipart body of an edit: the text fields as strings, the image file and the painted mask (PNG). */
  function editBody(s, edit) {
    const form = new FormData();
    const fields = { prompt: s.prompt, n: s.n, num_inference_steps: s.steps, sampler: s.sampler,
      schedule: s.schedule, output_format: "png", response_format: "b64_json", stream: "true" };
    if (s.size !== AUTO_SIZE) fields.size = s.size.replace(/\s+/g, "").replace("×", "x").toLowerCase();
    if (sentModel(s)) fields.model = s.model;
    if (s.negative_prompt.trim()) fields.negative_prompt = s.negative_prompt;
    if (s.syntax) fields.prompt_syntax = s.syntax;
    if (s.guidance !== "") fields.guidance_scale = s.guidance;
    if (s.seed !== "") fields.seed = s.seed;
    if (s.strength !== "") fields.strength = s.strength;
    if (s.lora) fields.loras = JSON.stringify([{ name: s.lora, scale: Number(s.lora_scale) }]);
    if (edit.control) fields.controls = JSON.stringify([edit.control.settings]);  // its map: control_image_0
    if (edit.imagePrompt) fields.image_prompts = JSON.stringify(edit.imagePrompt.settings);  // image_prompt_<i>
    for (const [k, v] of Object.entries(fields)) form.append(k, String(v));
    if (edit.references) {  // every image[] part a reference, the image to edit first
      form.append("image[]", edit.file, edit.file.name || "image.png");
      edit.references.forEach((f, i) => form.append("image[]", f, f.name || `reference${i}.png`));
    } else {
      form.append("image", edit.file, edit.file.name || "image.png");
    }
    if (edit.control) form.append("control_image_0", edit.control.file, edit.control.file.name || "control.png");
    if (edit.imagePrompt) {
      edit.imagePrompt.files.forEach((f, i) => form.append(`image_prompt_${i}`, f, f.name || `prompt${i}.png`));
    }
    if (edit.mask) form.append("mask", edit.mask, "mask.png");
    return form;
  }

  // -- the image of an edit, and its mask brush -------------------------------------------------------------
  function loadImageFile(file) {
    clearFieldError("image");
    if (!file) return;
    const url = URL.createObjectURL(file);
    const img = new Image();
    img.onload = () => {
      URL.revokeObjectURL(url);
      const w = img.naturalWidth, h = img.naturalHeight;
      for (const c of [$("image-canvas"), $("mask-canvas")]) { c.width = w; c.height = h; }
      $("image-canvas").getContext("2d").drawImage(img, 0, 0);
      Object.assign(app.edit, { file, width: w, height: h, painted: false });
      $("edit-area").hidden = false;
      addAutoSize();
      $("size").value = AUTO_SIZE;
      syncCustomSize();
      document.body.dataset.editImage = `${w}x${h}`;
    };
    img.onerror = () => {
      URL.revokeObjectURL(url);
      showError("image", "This file is not an image the browser can read; choose a PNG, JPEG or WebP.");
      $("image").value = "";
    };
    img.src = url;
  }

  /* The size choice of an edit: the image's own (rounded down to multiples of 8, as the server does). */
  function addAutoSize() {
    const select = $("size");
    let auto = select.querySelector(`option[value="${AUTO_SIZE}"]`);
    if (!auto) { auto = el("option", { value: AUTO_SIZE }); select.prepend(auto); }
    const { width: w, height: h } = app.edit;
    auto.textContent = `the image's (${w - (w % 8)}x${h - (h % 8)})`;
  }

  function removeImage() {
    Object.assign(app.edit, { file: null, width: 0, height: 0, painted: false });
    $("image").value = "";
    $("edit-area").hidden = true;
    const auto = $("size").querySelector(`option[value="${AUTO_SIZE}"]`);
    if (auto) auto.remove();
    if ($("size").value === AUTO_SIZE || !$("size").value) $("size").selectedIndex = 0;
    syncCustomSize();
    delete document.body.dataset.editImage;
  }

  function clearMask() {
    const c = $("mask-canvas");
    c.getContext("2d").clearRect(0, 0, c.width, c.height);
    app.edit.painted = false;
    document.body.dataset.maskPainted = "false";
  }

  function paint(event) {
    const c = $("mask-canvas");
    const rect = c.getBoundingClientRect();
    const x = (event.clientX - rect.left) * (c.width / rect.width);
    const y = (event.clientY - rect.top) * (c.height / rect.height);
    const radius = Number($("brush").value) * (c.width / Math.max(1, rect.width)) / 2;
    const ctx = c.getContext("2d");
    ctx.fillStyle = "#ffffff";
    ctx.beginPath();
    ctx.arc(x, y, Math.max(0.5, radius), 0, 2 * Math.PI);
    ctx.fill();
    app.edit.painted = true;
    document.body.dataset.maskPainted = "true";
  }

  /* The mask as the server reads one without alpha: white where painted (repaint), black elsewhere. */
  function maskBlob() {
    const src = $("mask-canvas");
    const out = document.createElement("canvas");
    out.width = src.width;
    out.height = src.height;
    const ctx = out.getContext("2d");
    ctx.fillStyle = "#000000";
    ctx.fillRect(0, 0, out.width, out.height);
    ctx.drawImage(src, 0, 0);
    return new Promise((resolve) => out.toBlob(resolve, "image/png"));
  }

  // -- one request: its card, its stream ------------------------------------------------------------------
  function makeCard(req) {
    const card = $("result-template").content.firstElementChild.cloneNode(true);
    card.dataset.localId = String(req.localId);
    card.dataset.state = "pending";
    card.querySelector(".prompt-line").textContent = req.settings.prompt;
    card.querySelector(".settings").textContent = summary(req.settings);
    card.querySelector(".seed").textContent = req.settings.seed ? `seed ${req.settings.seed}` : "seed: server picks";
    const bar = card.querySelector("progress");
    bar.max = Number(req.settings.steps) || 1;
    bar.value = 0;
    bar.setAttribute("aria-label", `progress of "${req.settings.prompt.slice(0, 60)}"`);
    card.querySelector(".progress-text").textContent = "queued…";
    const model = sentModel(req.settings) ? app.picker.find(req.settings.model) : null;
    if (model && !model.resident) {  // its first request loads it: say so until the first step
      card.dataset.modelLoading = "true";
      card.querySelector(".progress-text").textContent =
        `loading ${model.id} (its first use: this can take a while)…`;
    }
    const m = /(\d+)\s*[xX×]\s*(\d+)/.exec(req.settings.size);
    const ratio = m && Number(m[1]) > 0 && Number(m[2]) > 0 ? `${m[1]} / ${m[2]}` : "1 / 1";
    card.querySelector(".images").append(el("div", { class: "placeholder", style: `aspect-ratio: ${ratio}`,
      "aria-hidden": "true" }));
    card.querySelector(".reuse").hidden = true;
    card.querySelector(".reuse").addEventListener("click", () => reuse(req.settings, req.usedSeed));
    card.querySelector(".cancel").addEventListener("click", () => req.controller.abort());
    $("results").prepend(card);
    $("results-empty").hidden = true;
    card.scrollIntoView({ block: "nearest" });  // a new result comes into view, whole
    return card;
  }

  function startRequest(settings, edit = null, control = null, imagePrompt = null, references = null) {
    const req = { localId: app.nextLocalId++, settings, edit, control, imagePrompt, references,
      controller: new AbortController(), progressEvents: 0 };
    req.card = makeCard(req);
    document.body.dataset.lastRequest = String(req.localId);  // lets a test find this request's card
    runRequest(req).finally(() => app.picker.refresh());  // a model it loaded is resident now
  }

  async function runRequest(req) {
    let response;
    try {
      response = req.edit
        ? await fetch("/v1/images/edits", {  // multipart: the browser sets the Content-Type with its boundary
          method: "POST", body: editBody(req.settings, req.edit), signal: req.controller.signal, cache: "no-store",
          headers: authHeaders({ Accept: "text/event-stream" }),
        })
        : await fetch("/v1/images/generations", {
          method: "POST", body: requestBody(req.settings, req.control, req.imagePrompt, req.references), signal: req.controller.signal, cache: "no-store",
          headers: authHeaders({ "Content-Type": "application/json", Accept: "text/event-stream" }),
        });
    } catch (e) {
      if (req.controller.signal.aborted) cancelled(req);
      else refused(req, { message: `Could not reach the server (${e.message}).` });
      return;
    }
    if (response.status === 401) {
      storeKey("");
      const key = await askForKey("The server refused the API key (401). Enter a valid key.");
      if (key) { runRequest(req); return; }
      refused(req, { message: "This server needs an API key: generation was not started." });
      return;
    }
    if (!response.ok) {
      refused(req, await readError(response), response.status);
      return;
    }
    const type = response.headers.get("content-type") || "";
    if (type.startsWith("text/event-stream")) {
      await readStream(req, response);
    } else {  // a plain JSON answer (a server that ignores "stream")
      const text = await response.text();
      let body = null;
      try { body = JSON.parse(text); } catch (e) { /* reported below */ }
      if (body) completed(req, body, seedOf(text));
      else failed(req, { message: "The server's answer could not be read." });
    }
  }

  async function readError(response) {
    try {
      const body = await response.json();
      if (body && body.error) return body.error;
    } catch (e) { /* not JSON */ }
    return { message: `The server answered ${response.status} ${response.statusText}.` };
  }

  /* The seed as the server wrote it (a JS number would round seeds above 2**53). */
  function seedOf(json) {
    const m = /"seed"\s*:\s*(\d+)/.exec(json);
    return m ? m[1] : null;
  }

  function parseEvent(block) {
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith(": progress ")) return { event: "progress", data: line.slice(": progress ".length) };
      if (!line || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") event = value;
      else if (field === "data") data.push(value);
    }
    return data.length ? { event, data: data.join("\n") } : null;
  }

  /* Splits a text stream into server-sent-event blocks (separated by a blank line), calling `onBlock` for each.
   * Only the new text is searched: a completed event carries every image as base64 and can be megabytes long. */
  function sseSplitter(onBlock) {
    let parts = [];       // the current block's text so far
    let lastChar = "";    // the last character of `parts`, for a blank line split across two chunks
    let pendingCR = false;
    return (chunk, final) => {
      let text = (pendingCR ? "\r" : "") + chunk;
      pendingCR = !final && text.endsWith("\r");  // maybe half of a \r\n
      if (pendingCR) text = text.slice(0, -1);
      text = text.replace(/\r\n?/g, "\n");
      if (lastChar === "\n" && text.startsWith("\n")) {
        onBlock(parts.join(""));
        parts = [];
        text = text.slice(1);
      }
      let cut;
      while ((cut = text.indexOf("\n\n")) >= 0) {
        parts.push(text.slice(0, cut));
        onBlock(parts.join(""));
        parts = [];
        text = text.slice(cut + 2);
      }
      if (text) parts.push(text);
      lastChar = parts.length ? parts[parts.length - 1].slice(-1) : "";
      if (final && parts.length) {
        onBlock(parts.join(""));
        parts = [];
      }
    };
  }

  /* Reads the server-sent events of one POST (server/stream.py): progress comment lines move the bar, previews
   * show the image forming, one `image_generation.completed` event per image (`image_edit.*` on the edits route;
   * the last ends it) or `error`. */
  async function readStream(req, response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let ended = false;
    const feed = sseSplitter((block) => {
      const ev = parseEvent(block);
      if (ev && !ended) ended = handleEvent(req, ev);
    });
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        feed(decoder.decode(value, { stream: true }), false);
      }
      feed(decoder.decode(), true);
    } catch (e) {
      if (req.controller.signal.aborted) { cancelled(req); return; }
      if (!ended) failed(req, { message: `The stream broke off (${e.message}).` });
      return;
    }
    if (!ended) failed(req, { message: "The stream ended before the image was ready." });
  }

  function handleEvent(req, ev) {
    let data;
    try { data = JSON.parse(ev.data); } catch (e) { return false; }
    if (ev.event === "progress" || data.type === "progress") {
      progressed(req, data);
      return false;
    }
    if (ev.event === "image_generation.partial_image" || ev.event === "image_edit.partial_image") {
      previewed(req, data);
      return false;
    }
    if (ev.event === "image_generation.completed" || ev.event === "image_edit.completed") {
      req.done = (req.done || []).concat([data]);
      if (req.done.length < data.n) return false;
      const images = req.done.slice().sort((a, b) => a.image_index - b.image_index);
      completed(req, { ...data, data: images.map((e) => ({ b64_json: e.b64_json, url: e.url })) }, seedOf(ev.data));
      return true;
    }
    if (ev.event === "error" || data.type === "error") {
      failed(req, data.error || { message: "The server reported an error." }, data.status);
      return true;
    }
    return false;
  }

  function progressed(req, data) {
    req.progressEvents += 1;
    const bar = req.card.querySelector("progress");
    bar.max = data.total;
    bar.value = data.step;
    req.card.dataset.step = String(data.step);
    req.card.dataset.total = String(data.total);
    req.card.dataset.progressEvents = String(req.progressEvents);
    req.card.dataset.state = "running";
    req.card.querySelector(".progress-text").textContent = `${data.step} / ${data.total} steps`;
  }

  /* A live preview: shown in place of the image it previews until the image arrives. */
  function previewed(req, data) {
    const images = req.card.querySelector(".images");
    const index = data.image_index || 0;
    let img = images.querySelector(`img.preview[data-index="${index}"]`);
    if (!img) {
      if (index === 0) images.replaceChildren();
      img = el("img", { class: "preview pixelated", "data-index": String(index), "data-testid": "preview-image",
        alt: `preview of "${req.settings.prompt.slice(0, 60)}"` });
      images.append(img);
    }
    img.src = `data:image/${data.output_format || "jpeg"};base64,${data.b64_json}`;
    req.previews = (req.previews || 0) + 1;
    req.card.dataset.previews = String(req.previews);
  }

  function completed(req, body, seedText) {
    const card = req.card;
    const seed = seedText || String(body.seed);
    req.usedSeed = seed;
    card.dataset.state = "done";
    card.dataset.seed = seed;
    card.dataset.requestId = body.id || "";
    card.classList.add("done");
    const text = card.querySelector(".progress-text");
    text.textContent = `${card.dataset.step || "?"} / ${card.dataset.total || req.settings.steps} steps · done`;
    card.querySelector(".seed").textContent = `seed ${seed}`;
    const t = body.timings || {};
    card.querySelector(".timings").textContent =
      `queue ${formatMs(t.queue_ms)} · denoise ${formatMs(t.denoise_ms)} · decode ${formatMs(t.decode_ms)} · ` +
      `total ${formatMs(t.total_ms)}`;
    const format = body.output_format || "png";
    const images = card.querySelector(".images");
    images.replaceChildren();
    const n = (body.data || []).length;
    (body.data || []).forEach((item, i) => {
      const src = `data:image/${format};base64,${item.b64_json}`;
      const img = el("img", { src, alt: `${req.settings.prompt} (seed ${seed}, image ${i + 1} of ${n})`,
        "data-testid": "result-image" });
      img.addEventListener("load", () => {
        if (img.naturalWidth < 256) img.classList.add("pixelated");
        if (i === n - 1) reveal(card);
      });
      const suffix = n > 1 ? `-${i + 1}` : "";
      const name = `diffgraph-${slug(req.settings.prompt)}-${seed}${suffix}.${EXTENSIONS[format] || format}`;
      const link = el("a", { class: "download", href: src, download: name, "data-testid": "download",
        "aria-label": `download image ${i + 1} as ${name}`, text: "download" });
      images.append(el("figure", {}, [img, link]));
    });
    card.querySelector(".cancel").hidden = true;
    card.querySelector(".reuse").hidden = false;
    $("seed-hint").textContent = `Empty: the server picks one. Last used: ${seed}.`;
    const first = body.data && body.data[0] ? `data:image/${format};base64,${body.data[0].b64_json}` : null;
    remember(req.settings, seed, t, body.id, first);
  }

  /* A finished card whose top is on screen is scrolled to show it whole (its images grew it); one the user
   * scrolled away from is left where it is. */
  function reveal(card) {
    const top = card.getBoundingClientRect().top;
    if (top >= 0 && top < window.innerHeight) card.scrollIntoView({ block: "nearest" });
  }

  /* Refused before the stream started (400, 429, 503, ...): no card, the error goes to its field. */
  function refused(req, error, status) {
    req.card.remove();
    if (!$("results").children.length) $("results-empty").hidden = false;
    const prefix = status === 429 ? "The server is busy (429): " : status === 503 ? "Not available (503): " : "";
    showError(error.param, prefix + (error.message || "The request failed."));
    const field = FIELD_FOR_PARAM[error.param];
    if (field) (field === "size" && !$("size-custom").hidden ? $("size-custom") : $(field)).focus();
  }

  /* Failed after the stream started (timeout, engine error): the card says so, and so does the field. */
  function failed(req, error, status) {
    const card = req.card;
    card.dataset.state = "failed";
    card.classList.add("failed");
    card.querySelector(".images").replaceChildren();
    card.querySelector(".card-error").textContent =
      `${status ? `${status}: ` : ""}${error.message || "The request failed."}`;
    card.querySelector(".cancel").hidden = true;
    card.querySelector(".reuse").hidden = false;
    if (error.param) showError(error.param, error.message);
  }

  function cancelled(req) {
    req.card.dataset.state = "cancelled";
    req.card.querySelector(".images").replaceChildren();
    req.card.querySelector(".card-error").textContent = "cancelled";
    req.card.querySelector(".cancel").hidden = true;
    req.card.querySelector(".reuse").hidden = false;
  }

  function reuse(settings, seed) {
    fillForm({ ...settings, seed: seed || settings.seed });
    $("generate-hint").textContent = "settings restored";
    $("prompt").focus();
    $("gen-form").scrollIntoView({ block: "nearest" });
  }

  // -- history (localStorage) -----------------------------------------------------------------------------
  function loadHistory() {
    try {
      const list = JSON.parse(localStorage.getItem(HISTORY_STORAGE) || "[]");
      return Array.isArray(list) ? list.filter((h) => h && h.settings).slice(0, HISTORY_CAP) : [];
    } catch (e) {
      return [];
    }
  }

  /* Saves the newest entries that fit: a full localStorage drops the oldest ones, then the thumbnails. */
  function saveHistory() {
    let list = app.history.slice(0, HISTORY_CAP);
    const attempt = (items) => {
      try { localStorage.setItem(HISTORY_STORAGE, JSON.stringify(items)); return true; } catch (e) { return false; }
    };
    while (list.length && !attempt(list)) {
      if (list.length === 1) {
        attempt(list.map((h) => ({ ...h, thumb: null })));
        return;
      }
      list = list.slice(0, Math.floor(list.length / 2));
    }
  }

  function thumbnail(src) {
    return new Promise((resolve) => {
      if (!src) { resolve(null); return; }
      const img = new Image();
      img.onload = () => {
        const scale = Math.min(1, THUMB_PX / Math.max(img.naturalWidth, img.naturalHeight));
        const canvas = document.createElement("canvas");
        canvas.width = Math.max(1, Math.round(img.naturalWidth * scale));
        canvas.height = Math.max(1, Math.round(img.naturalHeight * scale));
        canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
        let url = canvas.toDataURL("image/webp", 0.8);
        if (!url.startsWith("data:image/webp")) url = canvas.toDataURL("image/jpeg", 0.8);
        resolve(url);
      };
      img.onerror = () => resolve(null);
      img.src = src;
    });
  }

  async function remember(settings, seed, timings, id, imageSrc) {
    const entry = { id: id || `local-${Date.now()}`, time: Date.now(), settings, seed, timings, thumb: null };
    app.history.unshift(entry);
    app.history = app.history.slice(0, HISTORY_CAP);
    entry.thumb = await thumbnail(imageSrc);
    saveHistory();
    renderHistory();
  }

  function renderHistory() {
    const list = $("history");
    list.replaceChildren();
    for (const h of app.history) {
      const s = h.settings;
      const thumb = h.thumb ? el("img", { src: h.thumb, alt: "", width: "48", height: "48" })
        : el("span", { class: "no-thumb", "aria-hidden": "true" });
      const when = new Date(h.time).toLocaleString(undefined, { dateStyle: "short", timeStyle: "short" });
      const use = el("button", { type: "button", class: "link", "data-testid": "history-reuse",
        "aria-label": `use the settings of "${s.prompt.slice(0, 40)}" again`, text: "use again" });
      use.addEventListener("click", () => reuse(s, h.seed));
      const text = el("div", { class: "h-text" }, [
        el("div", { class: "h-prompt", title: s.prompt, text: s.prompt }),
        el("div", { class: "h-meta", text: `${summary(s)} · seed ${h.seed}` }),
        el("div", { class: "h-meta", text: `${when} · ${formatMs(h.timings && h.timings.total_ms)}` }),
        use,
      ]);
      list.append(el("li", { "data-testid": "history-item", "data-seed": String(h.seed) }, [thumb, text]));
    }
    $("history-empty").hidden = app.history.length > 0;
  }

  // -- status panel -------------------------------------------------------------------------------------
  function setStatus(id, text, cls) {
    const node = $(id);
    node.textContent = text;
    node.className = cls || "";
  }

  function renderStatus(s) {
    if (s.error) setStatus("status-ready", `error: ${s.error}`, "no");
    else if (s.draining) setStatus("status-ready", "draining", "no");
    else setStatus("status-ready", s.ready ? "yes" : "loading…", s.ready ? "yes" : "no");
    setStatus("status-queue", String(s.queue_depth ?? "—"));
    setStatus("status-inflight", String(s.inflight ?? "—"));
    const live = Object.entries(s.live_rows || {});
    setStatus("status-live", live.length ? live.map(([size, n]) => `${size}: ${n}`).join(", ") : "none");
    setStatus("status-step", s.step_ms_last === null || s.step_ms_last === undefined ? "—"
      : `last ${s.step_ms_last} · mean ${s.step_ms_mean}`);
    setStatus("status-steps", String(s.steps ?? "—"));
    const buckets = s.graph_buckets || [];
    const eager = app.info && app.info.mode === "eager";
    setStatus("status-buckets", buckets.length ? buckets.join(", ") : eager ? "none (eager mode)" : "none captured");
    $("status-error").textContent = "";
  }

  async function pollStatus() {
    try {
      const r = await fetch("/status", { headers: authHeaders(), cache: "no-store" });
      if (r.ok) renderStatus(await r.json());
      else if (r.status === 401) $("status-error").textContent = "The status needs the API key.";
      else $("status-error").textContent = `GET /status answered ${r.status}.`;
    } catch (e) {
      $("status-error").textContent = "The server is unreachable.";
    }
    setTimeout(pollStatus, STATUS_EVERY_MS);
  }

  // -- wiring ---------------------------------------------------------------------------------------------
  function init() {
    app.imagePrompt = window.DiffgraphControls.createImagePrompt({ $, headers: (extra) => authHeaders(extra) });
    app.references = window.DiffgraphControls.createReferences({ $ });
    app.controls = window.DiffgraphControls.create({ $, headers: (extra) => authHeaders(extra),
      size: () => currentSize(), onError: (m) => { $("error-control-model").textContent = m; } });
    $("size").addEventListener("change", () => app.controls.refreshPreview());
    app.picker = window.DiffgraphModels.createPicker({ select: $("model"), field: $("model-field"),
      hint: $("model-hint"), headers: () => authHeaders(), onChange: onModel });
    $("gen-form").addEventListener("submit", onGenerate);
    $("size").addEventListener("change", () => {
      $("size").dataset.touched = "true";
      syncCustomSize();
      clearFieldError("size");
      if ($("size").value === "custom") $("size-custom").focus();
    });
    for (const id of FIELDS) {
      $(id).addEventListener("input", () => { $(id).dataset.touched = "true"; clearFieldError(id); });
    }
    $("size-custom").addEventListener("input", () => clearFieldError("size"));
    $("image").addEventListener("change", () => loadImageFile($("image").files[0]));
    $("image-remove").addEventListener("click", removeImage);
    $("mask-clear").addEventListener("click", clearMask);
    const mask = $("mask-canvas");
    mask.addEventListener("pointerdown", (e) => {
      app.edit.drawing = true;
      mask.setPointerCapture(e.pointerId);
      paint(e);
    });
    mask.addEventListener("pointermove", (e) => { if (app.edit.drawing) paint(e); });
    for (const type of ["pointerup", "pointercancel"]) mask.addEventListener(type, () => { app.edit.drawing = false; });
    $("seed-random").addEventListener("click", () => {
      const word = new Uint32Array(1);
      crypto.getRandomValues(word);
      $("seed").value = String(word[0] % 2 ** 31);
      clearFieldError("seed");
    });
    $("api-key-button").addEventListener("click", () => askForKey("Enter the API key for this server."));
    $("history-clear").addEventListener("click", () => {
      app.history = [];
      try { localStorage.removeItem(HISTORY_STORAGE); } catch (e) { /* nothing stored */ }
      renderHistory();
    });
    app.history = loadHistory();
    renderHistory();
    loadInfo();
    pollStatus();
  }

  init();
})();
