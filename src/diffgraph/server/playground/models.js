/* The playground's model picker (issue 29): the models GET /v1/models lists, in the form's <select>.
 *
 * With --model-dir the listing names every model of the folder: which is the default, which are resident ("loaded")
 * and which load on their first request, and the ones that cannot be served (an `error` of `error_kind` "file": shown
 * disabled, the reason as the option's tooltip and in the hint when one is picked from the history); one whose last
 * load failed (`error_kind` "load") stays selectable, since its next request tries again, its error in the hint. Without it the listing is
 * OpenAI's plain one-model shape and the picker stays hidden. The list is read again when the page gains focus,
 * every 30 s and after each request (a cheap GET). app.js owns the form; this file hands it the chosen model's id
 * (`chosen`), its listing entry (`find`) and tells it when the choice or the listing changes (`onChange`).
 */
"use strict";

window.DiffgraphModels = (() => {
  const REFRESH_MS = 30000;

  function option(value, text, title) {
    const node = document.createElement("option");
    node.value = value;
    node.textContent = text;
    if (title) node.title = title;
    return node;
  }

  function megabytes(bytes) {
    return bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(1)} GiB` : `${Math.max(1, Math.round(bytes / 2 ** 20))} MiB`;
  }

  /* "sdxl 1024×1024", or what of it the listing knows (a model not loaded yet may not say). */
  function shape(m) {
    const size = m.native_size ? `${m.native_size}×${m.native_size}` : "";
    return [m.family, size].filter(Boolean).join(" ");
  }

  function state(m) {
    if (m.resident) return "loaded";
    return m.loading ? "loading…" : "loads on first use";
  }

  function label(m) {
    return [m.id, shape(m), m.default ? "default" : "", state(m)].filter(Boolean).join(" · ");
  }

  /* What the hint under the picker says of the chosen model. */
  /* A model the server cannot serve as its file is; one whose last load failed is retried by its next request. */
  function unservable(m) {
    return Boolean(m.error) && m.error_kind !== "load";
  }

  function describe(m) {
    if (!m) return "";
    const bits = [];
    if (m.error) bits.push(`Its last load failed (${m.error}); a request tries again.`);
    if (m.resident) bits.push(`Loaded${m.memory_bytes ? ` (${megabytes(m.memory_bytes)})` : ""}: it starts at once.`);
    else if (m.loading) bits.push("Loading now: a request waits until it is ready.");
    else bits.push("Not loaded: the first request loads it, which can take a while.");
    if (m.hash) bits.push(`Hash ${m.hash}.`);
    return bits.join(" ");
  }

  /* The picker over `select` (inside `field`, hidden with one model), `hint` its text; `headers()` gives the
   * request headers (the API key); `onChange(model)` runs when the chosen model's entry may have changed. */
  function createPicker({ select, field, hint, headers, onChange }) {
    const picker = { models: [], byId: new Map(), defaultId: "", pending: null, note: "", running: null };

    function usable(id) {
      const m = picker.byId.get(id);
      return Boolean(m && !unservable(m));
    }

    function render() {
      const previous = select.value;
      const served = picker.models.filter((m) => !unservable(m));
      const broken = picker.models.filter(unservable);
      select.replaceChildren(...served.map((m) => option(m.id, label(m), m.default ? "the server's default" : "")));
      if (broken.length) {
        const group = document.createElement("optgroup");
        group.label = "cannot be served";
        for (const m of broken) {
          const node = option(m.id, `${m.id} · cannot be served`, m.error);
          node.disabled = true;
          group.append(node);
        }
        select.append(group);
      }
      const wanted = picker.pending !== null ? picker.pending : previous;
      picker.pending = null;
      if (wanted && usable(wanted)) {
        select.value = wanted;
      } else {
        if (wanted && picker.byId.size) picker.note = noteFor(wanted);
        select.value = picker.defaultId;
      }
      field.hidden = picker.models.length < 2;
      showHint();
    }

    function noteFor(id) {
      const m = picker.byId.get(id);
      const why = m ? `cannot be served (${m.error})` : "is not served now";
      return `${id} ${why}: the default is chosen instead.`;
    }

    function showHint() {
      hint.textContent = [picker.note, describe(picker.byId.get(select.value))].filter(Boolean).join(" ");
    }

    function apply(listing) {
      const data = (listing && Array.isArray(listing.data) ? listing.data : []).filter((m) => m && m.id);
      // the plain OpenAI shape has no `default`: its one model is the default
      const models = data.map((m) => ({ ...m, default: data.length === 1 || Boolean(m.default),
        resident: data.length === 1 && m.resident === undefined ? true : Boolean(m.resident) }));
      models.sort((a, b) => Number(b.default) - Number(a.default));  // the default first, then the server's order
      picker.models = models;
      picker.byId = new Map(models.map((m) => [m.id, m]));
      picker.defaultId = models.length && models[0].default ? models[0].id : "";
      render();
      select.dataset.models = String(models.length);  // the listing has been read (tests wait for it)
      onChange(picker.byId.get(select.value) || null);
    }

    /* Reads GET /v1/models again; one read at a time. A refusal (401 before the key is known) keeps the last list. */
    function refresh() {
      if (picker.running) return picker.running;
      picker.running = (async () => {
        try {
          const r = await fetch("/v1/models", { headers: headers(), cache: "no-store" });
          if (r.ok) apply(await r.json());
        } catch (e) { /* unreachable for now: the next refresh tries again */ }
        picker.running = null;
      })();
      return picker.running;
    }

    select.addEventListener("change", () => {
      picker.note = "";
      showHint();
      onChange(picker.byId.get(select.value) || null);
    });
    window.addEventListener("focus", () => refresh());
    document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
    setInterval(() => { if (!document.hidden) refresh(); }, REFRESH_MS);

    return {
      refresh,
      /* The chosen model's id ("" before the listing is read). */
      chosen: () => select.value || picker.defaultId,
      defaultId: () => picker.defaultId,
      find: (id) => picker.byId.get(id) || null,
      several: () => picker.models.length > 1,
      /* Chooses `id` (a history entry's model), or the default with a note when it is not served now; before the
       * listing is read, the choice waits for it. */
      restore(id) {
        picker.note = "";
        if (!picker.byId.size) { picker.pending = id || ""; return; }
        if (!id || usable(id)) select.value = id || picker.defaultId;
        else { picker.note = noteFor(id); select.value = picker.defaultId; }
        showHint();
        onChange(picker.byId.get(select.value) || null);
      },
    };
  }

  return { createPicker };
})();
