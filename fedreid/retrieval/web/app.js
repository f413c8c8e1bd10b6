// Gallery search page: vanilla JS over the service's JSON API (see fedreid/retrieval/service.py).
// The token lives in sessionStorage (this tab only) and is sent as "Authorization: Bearer ...";
// images are fetched with it and shown through blob: URLs, so it never appears in a URL.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const TOKEN_KEY = "fedreid.token";
  const state = {
    token: sessionStorage.getItem(TOKEN_KEY) || "", file: null, results: [], urls: [], current: null, limits: null,
  };

  // ---------------------------------------------------------------- helpers

  function showMessage(text, kind = "error") {
    const box = $("message");
    box.textContent = text;
    box.className = `message ${kind}`;
    box.hidden = !text;
  }

  function setStatus(text, ok) {
    const s = $("status");
    s.textContent = text;
    s.classList.toggle("ok", !!ok);
  }

  async function api(method, path, body) {
    const headers = {};
    if (state.token) headers.Authorization = `Bearer ${state.token}`;
    let response;
    try {
      response = await fetch(path, { method, headers, body, cache: "no-store" });
    } catch (err) {
      throw new Error(`cannot reach the server (${err.message})`);
    }
    if (!response.ok) {
      let message = `${response.status} ${response.statusText}`;
      try {
        const data = await response.json();
        if (data && data.error) message = data.error;
      } catch (_) { /* not JSON */ }
      const error = new Error(message);
      error.status = response.status;
      throw error;
    }
    return response;
  }

  async function imageURL(path) {
    const blob = await (await api("GET", path)).blob();
    const url = URL.createObjectURL(blob);
    state.urls.push(url);
    return url;
  }

  function releaseImages() {
    state.urls.forEach((u) => URL.revokeObjectURL(u));
    state.urls = [];
  }

  function formatTime(ts) {
    if (ts === null || ts === undefined) return "—";
    if (Math.abs(ts) >= 1e8) {  // POSIX seconds: show as a UTC date-time
      return new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
    }
    return String(ts);
  }

  const show = (v) => (v === null || v === undefined || v === "" ? "—" : String(v));

  // ---------------------------------------------------------------- connecting

  async function connect() {
    if (!state.token) {
      setStatus("Not connected", false);
      return false;
    }
    try {
      const info = await (await api("GET", "/info")).json();
      setStatus(`Connected · ${info.items} items · ${info.model.backbone || "model"} ${info.model.height}×${info.model.width}`, true);
      state.limits = info.limits;
      $("k").max = info.limits.max_k;
      $("add-block").hidden = !info.uploads;
      showMessage("");
      return true;
    } catch (err) {
      setStatus("Not connected", false);
      showMessage(err.status === 401 ? "The token was refused: check it and connect again." : err.message);
      return false;
    }
  }

  $("token-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    state.token = $("token").value.trim();
    if (state.token) sessionStorage.setItem(TOKEN_KEY, state.token);
    else sessionStorage.removeItem(TOKEN_KEY);
    if (await connect() && (state.file || $("item").value)) runSearch();
  });

  // ---------------------------------------------------------------- query image

  function tooLarge(file) {
    const limit = state.limits && state.limits.max_upload_bytes;
    if (limit && file.size > limit) {
      showMessage(`${file.name} has ${file.size} bytes; the server accepts images of up to ${limit} bytes.`);
      return true;
    }
    return false;
  }

  function setFile(file) {
    if (!file) return;
    state.file = file;
    $("item").value = "";
    const preview = $("preview");
    if (preview.dataset.url) URL.revokeObjectURL(preview.dataset.url);
    preview.dataset.url = URL.createObjectURL(file);
    preview.src = preview.dataset.url;
    preview.alt = `query: ${file.name}`;
    preview.hidden = false;
    $("drop-text").textContent = file.name;
    $("drop").classList.add("has-file");
    if (state.token) runSearch();
  }

  $("file").addEventListener("change", () => setFile($("file").files[0]));
  const drop = $("drop");
  ["dragenter", "dragover"].forEach((name) => drop.addEventListener(name, (e) => {
    e.preventDefault();
    drop.classList.add("over");
  }));
  ["dragleave", "drop"].forEach((name) => drop.addEventListener(name, (e) => {
    e.preventDefault();
    drop.classList.remove("over");
  }));
  drop.addEventListener("drop", (e) => {
    const file = e.dataTransfer && e.dataTransfer.files[0];
    if (file) setFile(file);
  });
  $("item").addEventListener("input", () => {
    if ($("item").value) {
      state.file = null;
      $("file").value = "";
      $("preview").hidden = true;
      $("drop").classList.remove("has-file");
      $("drop-text").innerHTML = "Drop an image here or <u>choose a file</u>";
    }
  });

  // ---------------------------------------------------------------- search

  function searchForm(itemId) {
    const form = new FormData();
    if (itemId !== undefined) form.append("item", String(itemId));
    else if ($("item").value) form.append("item", $("item").value);
    else if (state.file) form.append("image", state.file, state.file.name);
    for (const name of ["k", "cameras", "sites", "since", "until"]) {
      const value = $(name).value.trim();
      if (value) form.append(name, value);
    }
    return form;
  }

  async function runSearch(itemId) {
    if (!state.token) {
      showMessage("Enter the access token and connect first.");
      return;
    }
    if (itemId === undefined && !state.file && !$("item").value) {
      showMessage("Choose a query image (or an item id) first.");
      return;
    }
    if (itemId === undefined && !$("item").value && tooLarge(state.file)) return;
    showMessage("");
    $("search").disabled = true;
    $("results-meta").textContent = "Searching…";
    try {
      const data = await (await api("POST", "/search", searchForm(itemId))).json();
      const what = data.query.kind === "item" ? `item ${data.query.item}` : (data.query.name || "the uploaded image");
      $("results-title").textContent = `Top ${data.results.length} for ${what}`;
      $("results-meta").textContent = `k = ${data.k} · ${data.took_ms.toFixed(1)} ms`;
      await render(data.results);
    } catch (err) {
      $("results-meta").textContent = "";
      showMessage(err.status === 401 ? "The token was refused: check it and connect again." : err.message);
    } finally {
      $("search").disabled = false;
    }
  }

  $("search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    runSearch();
  });

  function card(result) {
    const li = document.createElement("li");
    li.className = "card";
    li.dataset.id = result.id;
    li.dataset.rank = result.rank;
    li.dataset.score = result.score;
    const button = document.createElement("button");
    button.type = "button";
    button.title = `${result.path} — open`;
    const figure = document.createElement("div");
    figure.className = "thumb";
    const img = document.createElement("img");
    img.alt = `rank ${result.rank}: ${result.path}`;
    figure.appendChild(img);
    const rank = document.createElement("span");
    rank.className = "rank";
    rank.textContent = `#${result.rank}`;
    figure.appendChild(rank);
    const info = document.createElement("div");
    info.className = "info";
    const score = document.createElement("div");
    score.className = "score";
    score.textContent = result.score.toFixed(3);
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.style.width = `${Math.max(0, Math.min(1, result.score)) * 100}%`;
    bar.appendChild(fill);
    const line1 = document.createElement("div");
    line1.className = "small";
    line1.textContent = `cam ${show(result.camera)}${result.site ? " · " + result.site : ""}`;
    const line2 = document.createElement("div");
    line2.className = "small muted";
    line2.textContent = formatTime(result.timestamp);
    info.append(score, bar, line1, line2);
    button.append(figure, info);
    button.addEventListener("click", () => openItem(result, img.src));
    li.appendChild(button);
    return { li, img };
  }

  async function render(results) {
    releaseImages();
    state.results = results;
    const grid = $("grid");
    grid.replaceChildren();
    $("empty").hidden = results.length > 0;
    if (!results.length) $("empty").textContent = "No gallery item matches these filters.";
    const cards = results.map(card);
    cards.forEach(({ li }) => grid.appendChild(li));
    await Promise.all(cards.map(async ({ li, img }, i) => {
      try {
        img.src = await imageURL(results[i].image_url);
      } catch (err) {
        li.classList.add("missing");
        img.alt = `image unavailable: ${err.message}`;
      }
    }));
    grid.dataset.ready = String(results.length);
  }

  // ---------------------------------------------------------------- one item

  function openItem(result, src) {
    state.current = result;
    $("item-image").src = src || "";
    $("item-image").alt = result.path;
    $("item-title").textContent = result.path;
    const rows = [
      ["Item id", result.id], ["Rank", result.rank], ["Score", result.score !== undefined ? result.score.toFixed(4) : undefined],
      ["Camera", result.camera], ["Site", result.site], ["Time", formatTime(result.timestamp)],
      ["Identity", result.identity], ["File", result.path],
    ];
    const dl = $("item-meta");
    dl.replaceChildren();
    for (const [key, value] of rows) {
      if (value === undefined) continue;
      const dt = document.createElement("dt");
      dt.textContent = key;
      const dd = document.createElement("dd");
      dd.textContent = show(value);
      dl.append(dt, dd);
    }
    $("item-dialog").showModal();
  }

  $("item-close").addEventListener("click", () => $("item-dialog").close());
  $("item-dialog").addEventListener("click", (e) => {
    if (e.target === $("item-dialog")) $("item-dialog").close();  // a click on the backdrop
  });
  $("item-similar").addEventListener("click", () => {
    const id = state.current.id;
    $("item-dialog").close();
    $("item").value = String(id);
    $("item").dispatchEvent(new Event("input"));
    runSearch(id);
  });
  $("item-delete").addEventListener("click", async () => {
    const { id, path } = state.current;
    if (!window.confirm(`Erase item ${id} (${path}) from the gallery? This cannot be undone.`)) return;
    try {
      await api("DELETE", `/items/${id}`);
      $("item-dialog").close();
      const li = document.querySelector(`.card[data-id="${id}"]`);
      if (li) li.remove();
      showMessage(`Item ${id} was erased from the gallery.`, "info");
      connect();
    } catch (err) {
      showMessage(err.message);
    }
  });

  // ---------------------------------------------------------------- adding

  $("add-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const file = $("add-file").files[0];
    if (!file) {
      showMessage("Choose an image to add.");
      return;
    }
    if (tooLarge(file)) return;
    const form = new FormData();
    form.append("image", file, file.name);
    for (const [id, name] of [["add-camera", "camera"], ["add-site", "site"], ["add-time", "timestamp"], ["add-identity", "identity"]]) {
      const value = $(id).value.trim();
      if (value) form.append(name, value);
    }
    try {
      const item = await (await api("POST", "/items", form)).json();
      showMessage(`Added ${file.name} as item ${item.id}.`, "info");
      $("add-form").reset();
      connect();
    } catch (err) {
      showMessage(err.message);
    }
  });

  // ---------------------------------------------------------------- start

  $("token").value = state.token;
  connect();
})();
