// bucketeer review: a virtual grid over the server's filtered, sorted view (only the visible cells exist),
// a detail panel, and decisions sent to the server, which writes each before it answers.
"use strict";
const CELL_W = 172, CELL_H = 200, BLOCK = 200;  // cell pitch (px); rows per /api/view request
const $ = (id) => document.getElementById(id);
const state = { where: "", sort: "", desc: false, count: 0, blocks: new Map(), pending: new Set(), selected: 0,
                generation: 0, detail: null };

// the token travels as a header, kept in this tab's sessionStorage and taken out of the address bar (history,
// bookmarks, a shared screen): the cookie holds only an image pass (it lets <img> tags and a reload load), so
// a page on another port of 127.0.0.1, which the browser sends that cookie from, can change nothing
const TOKEN = new URLSearchParams(location.search).get("token") || sessionStorage.getItem("bucketeer-token") || "";
sessionStorage.setItem("bucketeer-token", TOKEN);
if (location.search.includes("token=")) history.replaceState(null, "", location.pathname);

async function api(path, body) {
  const headers = { "X-Bucketeer-Token": TOKEN };
  const init = body === undefined ? { headers } : { method: "POST", body: JSON.stringify(body),
                                                    headers: { ...headers, "Content-Type": "application/json" } };
  const response = await fetch(path, init);
  const text = await response.text();
  let data;
  try { data = JSON.parse(text); } catch { data = { error: text || response.statusText }; }  // the gate's refusals
  if (!response.ok) { showError(data.error || response.statusText); throw new Error(data.error); }
  showError("");
  return data;
}

// decisions and reloads run one at a time, in the order asked: a slow answer never lands after a later one
let queue = Promise.resolve();
function serial(fn) {
  queue = queue.then(fn, fn).catch(() => {});
  return queue;
}

function showError(text) { $("error").textContent = text; $("error").hidden = !text; }

function query(offset, histogram) {
  const p = new URLSearchParams({ where: state.where, sort: state.sort, desc: state.desc ? "1" : "0",
                                  offset: String(offset), limit: String(BLOCK), histogram: histogram ? "1" : "0" });
  return "api/view?" + p.toString();
}

function columns() { return Math.max(1, Math.floor($("scroller").clientWidth / CELL_W)); }

function showCounts(counts) {
  $("decided").textContent = `kept ${counts.kept} · rejected ${counts.rejected} · edited ${counts.edited}`;
  $("undo").disabled = counts.undoable === 0;
}

async function reload(keepScroll) {
  state.generation += 1;
  const generation = state.generation;
  const data = await api(query(0, true));
  if (generation !== state.generation) return;
  state.blocks = new Map([[0, data.rows]]);
  $("grid").replaceChildren();
  state.pending = new Set();
  state.count = data.count;
  $("count").textContent = `${data.count.toLocaleString()} samples`;
  showCounts(data.counts);
  drawHistogram(data.histogram);
  $("grid").style.height = Math.ceil(state.count / columns()) * CELL_H + "px";
  if (!keepScroll) { $("scroller").scrollTop = 0; state.selected = 0; }
  render();
  performance.mark("bucketeer-grid");  // the grid is drawn (benchmarks/review.py reads it)
}

function drawHistogram(h) {
  const box = $("hist");
  box.replaceChildren();
  if (!h) return;
  const label = document.createElement("span");
  label.className = "label";
  if (h.kind === "bool") {
    label.textContent = `${state.sort}: true ${h.true} · false ${h.false} · none ${h.null}`;
    box.append(label);
    return;
  }
  const top = Math.max(1, ...h.counts);
  label.textContent = h.edges.length ? `${state.sort} ${h.edges[0].toPrecision(3)} … ${
    h.edges[h.edges.length - 1].toPrecision(3)}` : `${state.sort}: no values`;
  box.append(label);
  h.counts.forEach((c, i) => {
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.height = (100 * c / top) + "%";
    bar.title = `${h.edges[i].toPrecision(3)} – ${h.edges[i + 1].toPrecision(3)}: ${c}`;
    box.append(bar);
  });
}

function shown(value) {
  return typeof value === "number" && !Number.isInteger(value) ? value.toPrecision(4) : String(value);
}

function rowAt(index) {
  const block = state.blocks.get(Math.floor(index / BLOCK));
  return block ? block[index % BLOCK] : undefined;
}

function fetchBlock(b) {
  if (state.blocks.has(b) || state.pending.has(b)) return;
  state.pending.add(b);
  const generation = state.generation;
  api(query(b * BLOCK, false)).then((data) => {
    if (generation !== state.generation) return;
    state.blocks.set(b, data.rows);
    state.pending.delete(b);
    render();
  }).catch(() => state.pending.delete(b));
}

function render() {
  // the visible cells only, each kept while it stays visible (a click's cell survives to its dblclick)
  const scroller = $("scroller"), grid = $("grid"), cols = columns();
  const first = Math.floor(scroller.scrollTop / CELL_H) * cols;
  const last = Math.min(state.count, first + (Math.ceil(scroller.clientHeight / CELL_H) + 2) * cols);
  const old = new Map([...grid.children].map((c) => [c.dataset.key, c]));
  const cells = [];
  for (let i = first; i < last; i++) {
    const row = rowAt(i);
    if (!row) { fetchBlock(Math.floor(i / BLOCK)); continue; }
    const key = `${i}:${row.id}`;
    let cell = old.get(key);
    if (!cell) {
      cell = document.createElement("div");
      cell.dataset.key = key;
      cell.dataset.id = row.id;
      cell.dataset.index = String(i);
      const img = document.createElement("img");
      img.loading = "lazy";
      img.src = "thumb/" + row.id;
      img.alt = row.filename;
      const name = document.createElement("div");
      name.className = "name";
      name.textContent = row.filename;
      const value = document.createElement("div");
      value.className = "name";
      value.textContent = state.sort ? `${state.sort}: ${shown(row.value)}` : row.bucket;
      cell.append(img, name, value);
    }
    old.delete(key);
    cell.className = "cell" + (row.keep === 1 ? " kept" : row.keep === 0 ? " rejected" : "") +
      (i === state.selected ? " selected" : "");
    cell.style.left = (i % cols) * CELL_W + "px";
    cell.style.top = Math.floor(i / cols) * CELL_H + "px";
    cells.push(cell);
  }
  for (const cell of old.values()) {  // scrolled away: its image request is dropped, not left to queue
    cell.querySelector("img").src = "";
    cell.remove();
  }
  for (const cell of cells) if (cell.parentNode !== grid) grid.append(cell);
}

function select(index) {
  if (state.count === 0) return;
  state.selected = Math.max(0, Math.min(state.count - 1, index));
  const scroller = $("scroller"), top = Math.floor(state.selected / columns()) * CELL_H;
  if (top < scroller.scrollTop) scroller.scrollTop = top;
  if (top + CELL_H > scroller.scrollTop + scroller.clientHeight) scroller.scrollTop = top + CELL_H - scroller.clientHeight;
  render();
}

function decide(keep) {
  const id = state.detail ? state.detail.id : (rowAt(state.selected) || {}).id;  // what was shown when asked
  if (id) serial(() => decideOn(id, keep));
}

async function decideOn(id, keep) {
  const data = await api("api/decide", { ids: [id], keep });
  showCounts(data.counts);
  for (const block of state.blocks.values()) for (const row of block) if (row.id === id) row.keep = keep ? 1 : 0;
  if (state.detail && state.detail.id === id) await openDetail(id, true);
  else if ((rowAt(state.selected) || {}).id === id) select(state.selected + 1);
  render();
}

async function openDetail(id, refresh) {
  const s = await api("api/sample/" + id);
  if (refresh && (!state.detail || state.detail.id !== id)) return;  // closed meanwhile: stay closed
  state.detail = s;
  $("detail").hidden = false;
  $("detail-name").textContent = s.filename;
  $("detail-image").src = "image/" + s.id;
  $("detail-state").textContent = s.keep === 1 ? "kept" : s.keep === 0 ? "rejected" : "undecided";
  $("detail-captions").replaceChildren(...s.captions.map((c) => {
    const li = document.createElement("li"); li.textContent = c; return li;
  }));
  $("caption-edit").value = s.edited_caption || "";
  const table = $("detail-columns");
  table.replaceChildren(...Object.entries(s.columns).map(([k, v]) => {
    const tr = document.createElement("tr");
    const a = document.createElement("td"), b = document.createElement("td");
    a.textContent = k; b.textContent = v === null ? "—" : String(v);
    tr.append(a, b); return tr;
  }));
  const cluster = $("detail-cluster");
  if (s.cluster && s.cluster.members.length > 1) {
    cluster.textContent = `${s.cluster.members.length} samples; keeper ${s.cluster.keeper}` +
      (s.cluster.keeper === s.id ? " (this one)" : "");
    $("keeper-figure").hidden = s.cluster.keeper === s.id || !s.cluster.keeper;
    if (s.cluster.keeper) $("keeper-image").src = "image/" + s.cluster.keeper;
  } else { cluster.textContent = "none"; $("keeper-figure").hidden = true; }
}

function closeDetail() { state.detail = null; $("detail").hidden = true; render(); }

async function saveCaption() {
  if (!state.detail) return;
  const data = await api("api/caption", { id: state.detail.id, caption: $("caption-edit").value });
  await openDetail(state.detail.id, true);
  showCounts(data.counts);
}

async function undo() {
  const data = await api("api/undo", {});
  showCounts(data.counts);
  await reload(true);
  if (state.detail) await openDetail(state.detail.id, true);
}

async function rejectAll() {
  const n = state.count;
  if (!n || !window.confirm(`Reject all ${n} samples the filter shows?`)) return;
  const data = await api("api/decide", { where: state.where, expected: n, keep: false });
  showCounts(data.counts);
  await reload(true);
}

async function start() {
  state.where = document.querySelector("meta[name='bucketeer-where']").content;  // the server's --where
  $("where").value = state.where;
  const first = serial(() => reload(false));  // the grid's first rows are asked for beside the page's info
  const info = await api("api/info");
  $("manifest").textContent = `${info.manifest} (${info.samples.toLocaleString()} samples)`;
  for (const c of info.columns) {
    const o = document.createElement("option"); o.value = c; o.textContent = c; $("sort").append(o);
  }
  $("query").addEventListener("submit", (e) => {
    e.preventDefault();
    state.where = $("where").value; state.sort = $("sort").value; state.desc = $("desc").checked;
    serial(() => reload(false));
  });
  $("scroller").addEventListener("scroll", render, { passive: true });
  window.addEventListener("resize", () => reload(true));
  $("grid").addEventListener("click", (e) => {
    const cell = e.target.closest(".cell"); if (cell) select(Number(cell.dataset.index));
  });
  $("grid").addEventListener("dblclick", (e) => {
    const cell = e.target.closest(".cell"); if (cell) openDetail(cell.dataset.id);
  });
  $("detail-close").onclick = closeDetail;
  $("detail-keep").onclick = () => decide(true);
  $("detail-reject").onclick = () => decide(false);
  $("caption-save").onclick = () => serial(saveCaption);
  $("undo").onclick = () => serial(undo);
  $("reject-all").onclick = () => serial(rejectAll);
  document.addEventListener("keydown", (e) => {
    if (e.target.tagName === "INPUT" || e.target.tagName === "TEXTAREA" || e.target.tagName === "SELECT") return;
    const cols = columns();
    const moves = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: cols, ArrowUp: -cols };
    if (e.key in moves && !state.detail) { e.preventDefault(); select(state.selected + moves[e.key]); }
    else if (e.key === "k") decide(true);
    else if (e.key === "x") decide(false);
    else if (e.key === "u" || (e.key === "z" && (e.ctrlKey || e.metaKey))) serial(undo);
    else if (e.key === "Enter" && !state.detail) { const row = rowAt(state.selected); if (row) openDetail(row.id); }
    else if (e.key === "e" && state.detail) { e.preventDefault(); $("caption-edit").focus(); }
    else if (e.key === "Escape") closeDetail();
  });
  await first;
}

start();
