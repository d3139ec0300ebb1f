/* The playground's ControlNet control (issue 32): a ControlNet the server serves (GET /v1/controlnets), a control
 * image, its preprocessor (none, canny with its thresholds, invert), AUTOMATIC1111's resize and control modes, and
 * its scale and window. The map the ControlNet will see is shown before generating: the image goes to
 * POST /v1/controlnets/preview whenever it or a setting that shapes the map changes (the engine prepares the same
 * map). app.js owns the form; this file hands it the control's settings (`settings`, kept in the history without
 * the image), the control for a JSON body (`forBody`, the image as base64) or for the edits form (`forForm`: the
 * settings and the file, sent as the part control_image_0), and restores settings from the history (`restore`).
 */
"use strict";

window.DiffgraphControls = (() => {
  function readDataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(String(reader.result));
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  function create({ $, headers, size, onError }) {
    const ids = ["control-model", "control-image", "control-preprocess", "control-low", "control-high",
      "control-resize", "control-mode", "control-scale", "control-start", "control-end"];
    const state = { file: null, dataUrl: "", previewSeq: 0 };

    function settings() {
      if (!$("control-model").value || !state.file) return null;
      return {
        model: $("control-model").value, preprocess: $("control-preprocess").value,
        canny_low: Number($("control-low").value), canny_high: Number($("control-high").value),
        resize_mode: $("control-resize").value, control_mode: $("control-mode").value,
        scale: Number($("control-scale").value), start: Number($("control-start").value),
        end: Number($("control-end").value),
      };
    }

    /* Form syntax only (the server checks ranges): [param, message] pairs. */
    function localErrors() {
      const s = settings();
      if (!s) return $("control-model").value && !state.file
        ? [["controls", "Choose a control image for the ControlNet, or set the ControlNet to none."]] : [];
      for (const k of ["scale", "start", "end", "canny_low", "canny_high"]) {
        if (!Number.isFinite(s[k])) return [["controls", `Enter the control's ${k.replace("_", " ")} as a number.`]];
      }
      return [];
    }

    async function forBody() {
      const s = settings();
      return s ? { ...s, image: state.dataUrl } : null;
    }

    function forForm() {
      const s = settings();
      return s ? { settings: s, file: state.file } : null;
    }

    async function refreshPreview() {
      const img = $("control-map");
      if (!state.file) { img.hidden = true; img.removeAttribute("src"); return; }
      const seq = ++state.previewSeq;
      const body = { image: state.dataUrl, preprocess: $("control-preprocess").value,
        canny_low: Number($("control-low").value) || 0, canny_high: Number($("control-high").value) || 0,
        resize_mode: $("control-resize").value };
      const wanted = size();
      if (/^\d+x\d+$/.test(wanted)) body.size = wanted;
      let r;
      try {
        r = await fetch("/v1/controlnets/preview", { method: "POST", cache: "no-store",
          headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
      } catch (e) { onError(`Could not reach the server for the control map (${e.message}).`); return; }
      if (seq !== state.previewSeq) return;  // a newer preview is on its way
      const answer = await r.json().catch(() => null);
      if (!r.ok || !answer) {
        onError(answer && answer.error ? answer.error.message : `The control map could not be made (${r.status}).`);
        return;
      }
      onError("");
      img.src = `data:image/png;base64,${answer.image}`;
      img.dataset.size = `${answer.width}x${answer.height}`;
      img.hidden = false;
    }

    async function onFile(file) {
      state.file = file || null;
      state.dataUrl = file ? await readDataUrl(file) : "";
      await refreshPreview();
    }

    async function load() {
      let listing = null;
      try {
        const r = await fetch("/v1/controlnets", { headers: headers(), cache: "no-store" });
        if (r.ok) listing = await r.json();
      } catch (e) { /* the control stays hidden */ }
      const names = listing ? listing.data.map((c) => c.name) : [];
      const select = $("control-model");
      const chosen = select.value;
      const option = (value, text) => Object.assign(document.createElement("option"), { value, textContent: text });
      select.replaceChildren(option("", "none"), ...names.map((n) => option(n, n)));
      if (names.includes(chosen)) select.value = chosen;
      $("controls").hidden = names.length === 0;
    }

    function restore(s) {
      if (!s) { $("control-model").value = ""; return; }
      const models = Array.from($("control-model").options).map((o) => o.value);
      $("control-model").value = models.includes(s.model) ? s.model : "";
      const fields = { "control-preprocess": s.preprocess, "control-low": s.canny_low, "control-high": s.canny_high,
        "control-resize": s.resize_mode, "control-mode": s.control_mode, "control-scale": s.scale,
        "control-start": s.start, "control-end": s.end };
      for (const [id, v] of Object.entries(fields)) if (v !== undefined) $(id).value = String(v);
    }

    $("control-image").addEventListener("change", () => onFile($("control-image").files[0]));
    for (const id of ["control-preprocess", "control-low", "control-high", "control-resize"]) {
      $(id).addEventListener("change", refreshPreview);
    }
    const syncCanny = () => {
      $("control-canny").hidden = $("control-preprocess").value !== "canny";
    };
    $("control-preprocess").addEventListener("change", syncCanny);
    syncCanny();
    return { ids, settings, localErrors, forBody, forForm, load, restore, refreshPreview };
  }

  /* The image prompt (IP-Adapter): an adapter the server serves (GET /v1/ip-adapters), one or two images and a
   * scale; sent as `image_prompts` (JSON: the images as data URLs; the edits form: its file parts image_prompt_<i>). */
  function createImagePrompt({ $, headers }) {
    const state = { files: [], dataUrls: [] };

    function settings() {
      if (!$("ip-model").value || !state.files.length) return null;
      return { model: $("ip-model").value, scale: Number($("ip-scale").value) };
    }

    function localErrors() {
      const s = settings();
      if ($("ip-model").value && !state.files.length) {
        return [["image_prompts", "Choose one or two images for the image prompt, or set the adapter to none."]];
      }
      if (s && !Number.isFinite(s.scale)) return [["image_prompts", "Enter the image prompt's scale as a number."]];
      return [];
    }

    async function onFiles(files) {
      state.files = Array.from(files || []).slice(0, 2);
      state.dataUrls = await Promise.all(state.files.map(readDataUrl));
      const shown = $("ip-images");
      shown.replaceChildren(...state.dataUrls.map((src) => Object.assign(document.createElement("img"),
        { src, alt: "an image of the image prompt", className: "control-map" })));
      shown.hidden = state.files.length === 0;
    }

    async function load() {
      let listing = null;
      try {
        const r = await fetch("/v1/ip-adapters", { headers: headers(), cache: "no-store" });
        if (r.ok) listing = await r.json();
      } catch (e) { /* the image prompt stays hidden */ }
      const names = listing ? listing.data.map((c) => c.name) : [];
      const select = $("ip-model");
      const chosen = select.value;
      const option = (value, text) => Object.assign(document.createElement("option"), { value, textContent: text });
      select.replaceChildren(option("", "none"), ...names.map((n) => option(n, n)));
      if (names.includes(chosen)) select.value = chosen;
      $("image-prompt").hidden = names.length === 0;
    }

    function restore(s) {
      const models = Array.from($("ip-model").options).map((o) => o.value);
      $("ip-model").value = s && models.includes(s.model) ? s.model : "";
      if (s && s.scale !== undefined) $("ip-scale").value = String(s.scale);
    }

    $("ip-images-input").addEventListener("change", () => onFiles($("ip-images-input").files));
    return {
      settings, localErrors, load, restore,
      forBody: () => (settings() ? { ...settings(), images: state.dataUrls.slice() } : null),
      forForm: () => (settings() ? { settings: settings(), files: state.files.slice() } : null),
    };
  }

  /* Reference images (a model whose capabilities take `reference_images`: FLUX.2's references, Qwen-Image-Edit's
   * input images), sent as `reference_images` (JSON: data URLs) or, with an image to edit, as image[] parts after it
   * (the edits route reads every part of such a model as one of them, the first also the start below strength 1).
   * At most what /info's `image_limits` says the model takes, the image to edit counted: more is refused before
   * sending, in the server's words (`tooMany`). */
  function tooMany(count, limit) {
    return `${count} ${limit.items}; send at most ${limit.max}`;
  }

  function createReferences({ $ }) {
    const state = { files: [], dataUrls: [], limit: null };

    function show(info) {
      const takes = Boolean(info && (info.extension_images || []).includes("reference_images"));
      state.limit = takes ? ((info.image_limits || {}).reference_images || null) : null;
      $("references").hidden = !takes;
      if (state.limit) $("ref-images-label").textContent = `Images (up to ${state.limit.max})`;
      return takes;
    }

    async function onFiles(files) {
      state.files = Array.from(files || []);
      state.dataUrls = await Promise.all(state.files.map(readDataUrl));
      const shown = $("ref-images");
      shown.replaceChildren(...state.dataUrls.map((src) => Object.assign(document.createElement("img"),
        { src, alt: "a reference image", className: "control-map" })));
      shown.hidden = state.files.length === 0;
    }

    const active = () => !$("references").hidden && state.files.length > 0;
    /* `editing`: an image to edit goes first among the image[] parts, so it counts against the limit too. */
    function localErrors(editing) {
      const count = active() ? state.files.length + (editing ? 1 : 0) : 0;
      return state.limit && count > state.limit.max ? [["reference_images", tooMany(count, state.limit)]] : [];
    }

    $("ref-images-input").addEventListener("change", () => onFiles($("ref-images-input").files));
    return {
      show, localErrors,
      count: () => (active() ? state.files.length : 0),
      forBody: () => (active() ? state.dataUrls.slice() : null),
      forForm: () => (active() ? state.files.slice() : null),
    };
  }

  return { create, createImagePrompt, createReferences };
})();
