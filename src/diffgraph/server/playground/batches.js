/* The playground's batches page (issue 35, point 5), on the batch jobs API (/v1/jobs, server/jobs_routes.py):
 * submit a job (a job file, or prompts x seeds x one varied field as a grid), list the caller's jobs, watch one
 * (GET /v1/jobs/ID every second while it runs), cancel or delete it, browse its items' candidates (a gallery with a
 * keyboard-driven full-size viewer) and keep picks, downloaded as JSON or as a zip of the PNGs (store-only zip
 * written by zip.js: the PNGs are compressed already).
 *
 * The API key is the playground's (sessionStorage diffgraph.apiKey, `Authorization: Bearer`); images are fetched
 * with it and shown from blob URLs, since an <img src> sends no header. Picks are kept in localStorage per job id;
 * the grid a job was made from (when made here) too, so picks can name the varied field's value.
 */
"use strict";

(() => {
  const KEY_STORAGE = "diffgraph.apiKey";
  const PICKS = (id) => `diffgraph.batchPicks.${id}`;
  const SPEC = (id) => `diffgraph.batchSpec.${id}`;
  const POLL_MS = 1000;
  const UNFINISHED = ["queued", "running", "paused"];  // paused: the server's disk is full (job.reason says so)
  const $ = (id) => document.getElementById(id);

  const app = {
    info: null, memoryKey: "", keyPrompt: null,
    job: null,        // the shown job's summary
    items: [],        // its results (GET /v1/jobs/ID/results, every page)
    picks: new Set(), // "ITEM-K" of the shown job
    images: new Map(),  // image URL -> Promise of {blob, url}
    view: null,       // {item, k}: the viewer's position (index into app.items, candidate)
    pollTimer: null, resultsDone: -1, resultsAt: 0,
  };

  // -- storage and the API key ------------------------------------------------------------------------
  function load(key, fallback) {
    try {
      const v = localStorage.getItem(key);
      return v === null ? fallback : JSON.parse(v);
    } catch (e) { return fallback; }
  }
  function save(key, value) {
    try { localStorage.setItem(key, JSON.stringify(value)); } catch (e) { /* storage full or off: this page only */ }
  }
  function currentKey() {
    try { return sessionStorage.getItem(KEY_STORAGE) || app.memoryKey; } catch (e) { return app.memoryKey; }
  }
  function authHeaders(extra = {}) {
    const key = currentKey();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
  }

  function askForKey() {
    if (app.keyPrompt) return app.keyPrompt;
    const dialog = $("key-dialog"), input = $("api-key"), error = $("key-error");
    error.textContent = "";
    input.value = "";
    app.keyPrompt = new Promise((resolve) => {
      const finish = (key) => {
        $("key-form").onsubmit = null;
        $("api-key-cancel").onclick = null;
        dialog.close();
        app.keyPrompt = null;
        resolve(key);
      };
      $("key-form").onsubmit = async (e) => {
        e.preventDefault();
        const key = input.value.trim();
        if (!key) return;
        const r = await fetch("/v1/models", { headers: { Authorization: `Bearer ${key}` }, cache: "no-store" })
          .catch(() => null);
        if (r && r.status === 401) { error.textContent = "The server did not accept this key."; return; }
        try { sessionStorage.setItem(KEY_STORAGE, key); } catch (e2) { /* this page only */ }
        app.memoryKey = key;
        finish(key);
      };
      $("api-key-cancel").onclick = () => finish(null);
      dialog.showModal();
      input.focus();
    });
    return app.keyPrompt;
  }

  /* fetch with the key; a 401 asks for the key once and retries. Answers the Response. */
  async function call(path, options = {}) {
    let r = await fetch(path, { cache: "no-store", ...options, headers: authHeaders(options.headers || {}) });
    if (r.status === 401 && await askForKey()) {
      r = await fetch(path, { cache: "no-store", ...options, headers: authHeaders(options.headers || {}) });
    }
    return r;
  }

  async function api(path, options = {}) {
    const r = await call(path, options);
    let body = null;
    try { body = await r.json(); } catch (e) { /* not JSON */ }
    if (!r.ok) {
      const message = (body && body.error && body.error.message) || `${r.status} ${r.statusText}`;
      throw Object.assign(new Error(message), { status: r.status });
    }
    return body;
  }

  // -- the model line ------------------------------------------------------------------------------
  async function loadInfo() {
    try {
      const r = await fetch("/info", { cache: "no-store" });
      app.info = await r.json();
    } catch (e) {
      $("model-line").textContent = "the server cannot be reached; retrying…";
      setTimeout(loadInfo, 2000);
      return;
    }
    const info = app.info;
    $("api-key-button").hidden = !info.auth_required;
    $("model-line").textContent = info.ready ? `${info.model} · ${info.family} · ready`
      : `${info.model} · loading…`;
    if (!info.ready) { setTimeout(loadInfo, 1000); return; }
    document.body.dataset.ready = "true";
    if (!$("steps").value) $("steps").placeholder = `server default (${info.default_steps})`;
    if (info.native_size && !$("size").value) $("size").placeholder = `${info.native_size}x${info.native_size}`;
    if (info.auth_required && !currentKey()) await askForKey();
    loadJobs();
  }

  // -- a new job -----------------------------------------------------------------------------------
  function parseValue(field, text) {
    const numeric = ["guidance_scale", "num_inference_steps"].includes(field);
    const n = Number(text);
    return numeric && text !== "" && Number.isFinite(n) ? n : text;
  }

  function gridJob() {
    const prompts = $("prompts").value.split("\n").map((p) => p.trim()).filter(Boolean);
    if (!prompts.length) throw new Error("Give at least one prompt (one a line).");
    const seedText = $("seeds").value.split(/[\s,]+/).filter(Boolean);
    const seeds = seedText.map(Number);
    if (seeds.some((s) => !Number.isInteger(s) || s < 0)) throw new Error("Seeds are whole numbers, comma separated.");
    const grid = { prompts };
    if (seeds.length) grid.seeds = seeds;
    const field = $("vary-field").value;
    if (field) {
      const values = $("vary-values").value.split(",").map((v) => v.trim()).filter((v) => v !== "");
      if (!values.length) throw new Error(`Give the values of ${field}, comma separated.`);
      grid.vary = { [field]: values.map((v) => parseValue(field, v)) };
    }
    const base = {};
    if ($("steps").value) base.num_inference_steps = Number($("steps").value);
    if ($("size").value.trim()) base.size = $("size").value.trim();
    if (Object.keys(base).length) grid.base = base;
    const job = { grid };
    if ($("job-name").value.trim()) job.name = $("job-name").value.trim();
    return job;
  }

  async function submitJob(event) {
    event.preventDefault();
    $("form-error").textContent = "";
    let body, type, grid = null, path = "/v1/jobs";
    try {
      if (document.querySelector("input[name=mode]:checked").value === "grid") {
        const job = gridJob();
        grid = job.grid;
        body = JSON.stringify(job);
        type = "application/json";
      } else {
        const file = $("job-file").files[0];
        if (!file) throw new Error("Choose a job file.");
        body = await file.text();
        let whole = null;
        try { whole = JSON.parse(body); } catch (e) { /* JSONL */ }
        type = whole && typeof whole === "object" && ("items" in whole || "grid" in whole)
          ? "application/json" : "application/x-ndjson";
        if (whole && whole.grid) grid = whole.grid;
        const name = $("job-name").value.trim();
        if (name && type !== "application/json") path += `?name=${encodeURIComponent(name)}`;
      }
    } catch (e) {
      $("form-error").textContent = e.message;
      return;
    }
    $("submit-job").disabled = true;
    try {
      const job = await api(path, { method: "POST", headers: { "Content-Type": type }, body });
      if (grid) save(SPEC(job.id), grid);
      await loadJobs();
      showJob(job.id);
    } catch (e) {
      $("form-error").textContent = e.message;
    } finally {
      $("submit-job").disabled = false;
    }
  }

  // -- the jobs list -------------------------------------------------------------------------------
  function countsText(job) {
    const c = job.counts;
    return `${c.done} done · ${c.failed} failed · ${c.pending} pending of ${c.candidates}`;
  }

  async function loadJobs() {
    $("jobs-error").textContent = "";
    let list;
    try {
      list = (await api("/v1/jobs?limit=50")).data;
    } catch (e) {
      $("jobs-error").textContent = e.message;
      return;
    }
    const ul = $("jobs");
    ul.replaceChildren();
    $("jobs-empty").hidden = list.length > 0;
    for (const job of list) {
      const li = document.createElement("li");
      li.dataset.testid = "job-item";
      li.dataset.jobId = job.id;
      li.dataset.status = job.status;
      if (app.job && app.job.id === job.id) li.classList.add("current");
      const text = document.createElement("div");
      text.className = "h-text";
      const title = document.createElement("p");
      title.className = "h-prompt";
      title.textContent = job.name || job.id;
      const meta = document.createElement("p");
      meta.className = "h-meta";
      meta.textContent = `${job.status} · ${countsText(job)}`;
      const open = document.createElement("button");
      open.type = "button";
      open.className = "link";
      open.textContent = "open";
      open.addEventListener("click", () => showJob(job.id));
      text.append(title, meta, open);
      li.append(text);
      ul.append(li);
    }
  }

  // -- one job ---------------------------------------------------------------------------------------
  function showJob(id) {
    clearTimeout(app.pollTimer);
    app.job = null;
    app.items = [];
    app.resultsDone = -1;
    app.resultsAt = 0;
    app.picks = new Set(load(PICKS(id), []));
    $("gallery").replaceChildren();
    for (const li of $("jobs").children) li.classList.toggle("current", li.dataset.jobId === id);
    poll(id);
  }

  function eta(seconds) {
    if (seconds === null || seconds === undefined) return "";
    if (seconds < 90) return `${Math.round(seconds)} s`;
    return seconds < 5400 ? `${Math.round(seconds / 60)} min` : `${(seconds / 3600).toFixed(1)} h`;
  }

  async function poll(id) {
    let job;
    try {
      job = await api(`/v1/jobs/${id}`);
    } catch (e) {
      if (!app.job || app.job.id === id) $("job-meta").textContent = e.message;
      return;
    }
    if (app.job && app.job.id !== id) return;  // another job was chosen meanwhile
    if (!app.job) app.job = job;
    const wasRunning = UNFINISHED.includes(app.job.status);
    app.job = job;
    const running = UNFINISHED.includes(job.status);
    renderJob(job);
    const finished = job.counts.done + job.counts.failed;
    // the results again when more are in: at most every 3 s while it runs (a big job's pages are many), and at its end
    if ((finished !== app.resultsDone && (!running || Date.now() - app.resultsAt > 3000)) || (wasRunning && !running)) {
      app.resultsDone = finished;
      app.resultsAt = Date.now();
      await loadResults(job);
    }
    if (running) app.pollTimer = setTimeout(() => poll(id), POLL_MS);
    else if (wasRunning) loadJobs();
    document.body.dataset.jobStatus = job.status;
  }

  function renderJob(job) {
    $("job-empty").hidden = true;
    $("job-detail").hidden = false;
    $("job-detail").dataset.jobId = job.id;
    $("job-detail").dataset.status = job.status;
    const c = job.counts;
    $("job-name-line").textContent = `${job.name || job.id} · ${job.status}`;
    $("job-progress").max = Math.max(1, c.candidates);
    $("job-progress").value = c.done + c.failed;
    $("job-progress-text").textContent = countsText(job);
    const parts = [`${c.items} items`, job.model];
    if (job.status === "paused" && job.reason) parts.push(`paused: ${job.reason}`);
    if (job.images_per_s) parts.push(`${job.images_per_s} images/s`);
    if (job.eta_s !== null && job.eta_s !== undefined) parts.push(`ETA ${eta(job.eta_s)}`);
    $("job-meta").textContent = parts.join(" · ");
    const running = UNFINISHED.includes(job.status);
    $("cancel-job").hidden = !running;
    $("delete-job").hidden = false;
  }

  async function loadResults(job) {
    const items = [];
    for (let offset = 0; ; ) {
      const page = await api(`/v1/jobs/${job.id}/results?offset=${offset}&limit=500`);
      items.push(...page.data);
      offset += page.data.length;
      if (!page.has_more || !page.data.length) break;
    }
    if (!app.job || app.job.id !== job.id) return;
    app.items = items;
    renderGallery();
  }

  /* The blob of an image URL (fetched once, with the key). */
  function image(url) {
    if (!app.images.has(url)) {
      app.images.set(url, call(url).then(async (r) => {
        if (!r.ok) throw new Error(`${r.status} for ${url}`);
        const blob = await r.blob();
        return { blob, url: URL.createObjectURL(blob) };
      }));
      app.images.get(url).catch(() => app.images.delete(url));
    }
    return app.images.get(url);
  }

  function spec() { return app.job ? load(SPEC(app.job.id), null) : null; }

  /* What the item's grid cell varied (when the page knows the grid): {field: value}. */
  function varied(item) {
    const grid = spec();
    if (!grid || !grid.vary) return {};
    const names = Object.keys(grid.vary);
    const out = {};
    let rest = item;
    for (let i = names.length - 1; i >= 0; i--) {
      const values = grid.vary[names[i]];
      out[names[i]] = values[rest % values.length];
      rest = Math.floor(rest / values.length);
    }
    return out;
  }

  function itemLine(item) {
    const extra = Object.entries(varied(item.item)).map(([k, v]) => `${k} ${v}`);
    return [`#${item.item}`, item.prompt, ...extra].join(" · ");
  }

  function renderGallery() {
    const gallery = $("gallery");
    gallery.replaceChildren();
    app.items.forEach((item, index) => {
      const li = document.createElement("li");
      li.className = `gallery-item ${item.status}`;
      li.dataset.testid = "gallery-item";
      li.dataset.item = item.item;
      li.dataset.status = item.status;
      const head = document.createElement("p");
      head.className = "meta";
      head.textContent = itemLine(item) + (item.error ? ` · ${item.error}` : "");
      const row = document.createElement("div");
      row.className = "candidates";
      item.images.forEach((url, k) => {
        const cell = document.createElement("button");
        cell.type = "button";
        cell.className = "candidate";
        cell.dataset.testid = "candidate";
        cell.dataset.key = `${item.item}-${k}`;
        cell.classList.toggle("picked", app.picks.has(cell.dataset.key));
        cell.title = `seed ${item.seeds[k]}`;
        if (url) {
          const img = document.createElement("img");
          img.alt = `item ${item.item}, seed ${item.seeds[k]}`;
          image(url).then((b) => { img.src = b.url; }).catch(() => { img.alt = "could not be loaded"; });
          cell.append(img);
          cell.addEventListener("click", () => openViewer(index, k));
        } else {
          cell.disabled = true;
          cell.textContent = item.status === "failed" ? "failed" : "…";
        }
        const seed = document.createElement("span");
        seed.className = "seed-tag";
        seed.textContent = item.seeds[k];
        cell.append(seed);
        row.append(cell);
      });
      li.append(head, row);
      gallery.append(li);
    });
    renderPicks();
  }

  // -- the viewer ------------------------------------------------------------------------------------
  function openViewer(index, k) {
    app.view = { index, k };
    $("viewer").hidden = false;
    renderViewer();
    $("viewer-close").focus();
  }

  function closeViewer() {
    $("viewer").hidden = true;
    const at = app.view;
    app.view = null;
    if (at) {
      const key = `${app.items[at.index].item}-${at.k}`;
      const cell = document.querySelector(`[data-testid=candidate][data-key="${key}"]`);
      if (cell) cell.focus();
    }
  }

  function renderViewer() {
    const { index, k } = app.view;
    const item = app.items[index];
    const key = `${item.item}-${k}`;
    const viewer = $("viewer");
    viewer.dataset.key = key;
    viewer.dataset.picked = String(app.picks.has(key));
    const img = $("viewer-image");
    img.removeAttribute("src");
    const url = item.images[k];
    if (url) image(url).then((b) => { if (viewer.dataset.key === key) img.src = b.url; });
    $("viewer-caption").textContent = `${itemLine(item)} · seed ${item.seeds[k]} · candidate ${k + 1} of ` +
      `${item.images.length}${app.picks.has(key) ? " · picked" : ""}`;
  }

  /* The next position with an image, moving by (dItem, dK); stays put when there is none. */
  function move(dItem, dK) {
    let { index, k } = app.view;
    if (dK) {
      const images = app.items[index].images;
      for (let j = k + dK; j >= 0 && j < images.length; j += dK) if (images[j]) { k = j; break; }
    } else {
      for (let i = index + dItem; i >= 0 && i < app.items.length; i += dItem) {
        const images = app.items[i].images;
        if (images.some(Boolean)) {
          index = i;
          k = images[Math.min(k, images.length - 1)] ? Math.min(k, images.length - 1) : images.findIndex(Boolean);
          break;
        }
      }
    }
    app.view = { index, k };
    renderViewer();
  }

  function onKey(event) {
    if (!app.view) return;
    const keys = {
      ArrowLeft: () => move(0, -1), ArrowRight: () => move(0, 1), ArrowUp: () => move(-1, 0),
      ArrowDown: () => move(1, 0), Escape: closeViewer, " ": togglePick, p: togglePick, P: togglePick,
    };
    const action = keys[event.key];
    if (!action) return;
    event.preventDefault();
    action();
  }

  // -- picks ---------------------------------------------------------------------------------------------
  function togglePick() {
    const item = app.items[app.view.index];
    const key = `${item.item}-${app.view.k}`;
    if (app.picks.has(key)) app.picks.delete(key); else app.picks.add(key);
    save(PICKS(app.job.id), [...app.picks]);
    const cell = document.querySelector(`[data-testid=candidate][data-key="${key}"]`);
    if (cell) cell.classList.toggle("picked", app.picks.has(key));
    renderViewer();
    renderPicks();
  }

  function renderPicks() {
    const n = app.picks.size;
    $("picks-count").textContent = `${n} pick${n === 1 ? "" : "s"}`;
    $("picks-count").dataset.count = n;
    $("download-json").disabled = $("download-zip").disabled = n === 0;
  }

  function pickList() {
    const out = [];
    for (const item of app.items) {
      item.images.forEach((url, k) => {
        if (!url || !app.picks.has(`${item.item}-${k}`)) return;
        out.push({ item: item.item, candidate: k, seed: item.seeds[k], prompt: item.prompt, ...varied(item.item),
                   url: new URL(url, location.href).href, file: `${item.item}-${k}.png` });
      });
    }
    return out;
  }

  function metadata() {
    const job = app.job;
    return { job: job.id, name: job.name, model: job.model, grid: spec(), picks: pickList() };
  }

  function offer(blob, name) {
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 60_000);
  }

  function downloadJson() {
    const blob = new Blob([JSON.stringify(metadata(), null, 2)], { type: "application/json" });
    offer(blob, `${app.job.id}-picks.json`);
  }

  async function downloadZip() {
    const button = $("download-zip");
    button.disabled = true;
    try {
      const meta = metadata();
      const files = [];
      for (const pick of meta.picks) {
        const { blob } = await image(pick.url);
        files.push({ name: pick.file, data: new Uint8Array(await blob.arrayBuffer()) });
      }
      files.push({ name: "metadata.json", data: new TextEncoder().encode(JSON.stringify(meta, null, 2)) });
      offer(new Blob([window.diffgraphZip.zipStore(files)], { type: "application/zip" }), `${app.job.id}-picks.zip`);
    } catch (e) {
      $("job-meta").textContent = `the zip could not be made: ${e.message}`;
    } finally {
      button.disabled = app.picks.size === 0;
    }
  }

  // -- wiring --------------------------------------------------------------------------------------------
  function init() {
    $("job-form").addEventListener("submit", submitJob);
    for (const radio of document.querySelectorAll("input[name=mode]")) {
      radio.addEventListener("change", () => {
        const file = document.querySelector("input[name=mode]:checked").value === "file";
        $("grid-fields").hidden = file;
        $("file-fields").hidden = !file;
      });
    }
    $("refresh-jobs").addEventListener("click", loadJobs);
    $("api-key-button").addEventListener("click", askForKey);
    $("cancel-job").addEventListener("click", async () => {
      try {
        renderJob(await api(`/v1/jobs/${app.job.id}/cancel`, { method: "POST" }));
      } catch (e) { $("job-meta").textContent = e.message; }
      loadJobs();
    });
    $("delete-job").addEventListener("click", async () => {
      const id = app.job.id;
      if (!confirm(`Delete job ${id} and its images?`)) return;
      clearTimeout(app.pollTimer);
      try {
        await api(`/v1/jobs/${id}`, { method: "DELETE" });
        try { localStorage.removeItem(PICKS(id)); localStorage.removeItem(SPEC(id)); } catch (e) { /* none */ }
        app.job = null;
        $("job-detail").hidden = true;
        $("job-empty").hidden = false;
      } catch (e) { $("job-meta").textContent = e.message; }
      loadJobs();
    });
    $("download-json").addEventListener("click", downloadJson);
    $("download-zip").addEventListener("click", downloadZip);
    $("viewer-close").addEventListener("click", closeViewer);
    $("viewer").addEventListener("click", (e) => { if (e.target === $("viewer")) closeViewer(); });
    document.addEventListener("keydown", onKey);
    loadInfo();
  }

  init();
})();
