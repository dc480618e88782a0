// The page of `aiayn serve`: translate, show the n-best list, draw the attention maps.
// Plain JavaScript, no libraries: the server sends every map as maps[kind][layer][head][row][col]
// (rows = queries, columns = keys, each row sums to 1).
"use strict";

const $ = (id) => document.getElementById(id);
// attention: the maps drawn; steps: the run's saved steps (GET /info); asked: the sentence
// and search of the last translation, which the step slider asks for again at each step.
// next: the sentence and translation whose next-piece distribution is shown.
const state = { attention: null, steps: [], asked: null, stepRequest: 0, next: null, nextRequest: 0 };

// The tokens along a map's axes: [rows (queries), columns (keys)], as the server names them.
function axes(kind) {
  const [rows, cols] = state.attention.axes[kind];
  return [state.attention[rows], state.attention[cols]];
}

async function post(path, body) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const data = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
  return data;
}

async function showInfo() {
  try {
    const info = await (await fetch("/info")).json();
    const m = info.model;
    const parts = [
      `${m.n_encoder_layers}+${m.n_decoder_layers} layers, d_model ${m.d_model}, ${m.n_heads} heads, ` +
        `d_ff ${m.d_ff}, ${info.parameters.toLocaleString("en")} parameters`,
      `vocabulary ${m.src_vocab_size}/${m.tgt_vocab_size} (${info.tokenizer})`,
    ];
    if (info.training_steps != null) parts.push(`${info.training_steps} training steps`);
    const best = info.best;  // what best.safetensors holds, chosen by train.best_metric
    if (best && best.bleu != null) {
      parts.push(`best (by dev ${best.metric}) step ${best.step}: dev BLEU ${best.bleu.toFixed(2)}`);
    }
    parts.push(`weights ${info.weights.split("/").pop()} on ${info.device}`);
    $("info").textContent = parts.join(" · ");
    state.steps = info.steps || [];
    showTargets(info.targets || []);
    // The run's own search (its config's decode section) is where the controls start.
    if (info.decode) {
      $("beam").value = Math.min(info.decode.beam, info.max_beam);
      $("alpha").value = info.decode.alpha;
    }
  } catch (err) {
    $("info").textContent = `no /info: ${err.message}`;
  }
}

// A model of several target languages: a menu of them (the first chosen), its choice sent as
// every request's "to". A model of one direction has no menu and sends no "to".
function showTargets(targets) {
  if (targets.length < 2) return;
  $("to").replaceChildren(...targets.map((lang) => new Option(lang, lang)));
  $("to-choice").hidden = false;
}

function direction() {
  return $("to-choice").hidden ? {} : { to: $("to").value };
}

function settings() {
  const beam = Number($("beam").value);
  // The n-best list can be at most as long as the beam.
  return { beam, alpha: Number($("alpha").value), nbest: Math.min(Number($("nbest-size").value), beam) };
}

async function translate(event) {
  event.preventDefault();
  const lines = $("source").value.split("\n");
  const first = lines.find((line) => line.trim() !== "");
  $("error").textContent = "";
  if (first === undefined) {
    $("error").textContent = "Type a sentence first.";
    return;
  }
  const { beam, alpha, nbest } = settings();
  const to = direction();
  const index = lines.indexOf(first);
  // The prefix is the first sentence's: the one whose attention and next pieces are shown.
  const prefix = lines.map((_, i) => (i === index ? $("prefix").value : null));
  $("status").textContent = "translating…";
  $("translate").disabled = true;
  try {
    const result = await post("/translate", { text: lines, beam, alpha, nbest, prefix, ...to });
    showTranslation(result);
    state.next = { text: first, target: result.translations[index] || null, ...to };
    $("next-step").value = 0;
    await showNext();
    $("status").textContent = "computing the attention…";
    state.asked = { text: first, beam, alpha, ...to };
    state.attention = await post("/attention", state.asked);
    fillPickers();
    drawHeatmap();
    showSteps();
    $("status").textContent = `done (${(result.seconds * 1000).toFixed(0)} ms to translate)`;
  } catch (err) {
    $("error").textContent = err.message;
    $("status").textContent = "";
  } finally {
    $("translate").disabled = false;
  }
}

function showTranslation(result) {
  $("translation").textContent = result.translations.join("\n");
  $("warnings").textContent = result.warnings.join(" ");
  const best = (result.nbest.find((hyps) => hyps.length > 0) || [])[0];
  $("confidence").textContent = best && best.log_probs
    ? `score ${best.score.toFixed(3)}: log-probability ${best.log_prob.toFixed(2)} over ` +
      `${best.log_probs.length} pieces; the least likely “${best.pieces[leastLikely(best)]}” ` +
      `(p ${Math.exp(best.log_probs[leastLikely(best)]).toFixed(2)})`
    : "";
  const list = $("nbest");
  list.replaceChildren();
  const firstNonEmpty = result.nbest.find((hyps) => hyps.length > 0) || [];
  for (const hyp of firstNonEmpty) {
    const item = document.createElement("li");
    const score = document.createElement("span");
    score.className = "score";
    score.textContent = hyp.score.toFixed(4);
    const text = document.createElement("span");
    text.className = "text";
    text.textContent = hyp.text;
    item.append(score, text);
    list.append(item);
  }
}

// The piece the model gave the lowest probability: where to look first when checking.
function leastLikely(hyp) {
  let at = 0;
  hyp.log_probs.forEach((p, i) => { if (p < hyp.log_probs[at]) at = i; });
  return at;
}

// Typing the start of the translation asks again once the typing pauses.
let prefixTimer = null;
function prefixChanged() {
  clearTimeout(prefixTimer);
  prefixTimer = setTimeout(() => $("form").requestSubmit(), 400);
}

// POST /next: the distribution of the translation's piece at the chosen step, drawn as bars.
async function showNext() {
  if (!state.next) return;
  const temperature = Number($("temperature").value);
  $("temperature-label").textContent = temperature.toFixed(2);
  const asked = ++state.nextRequest;  // a later move of a slider makes this answer stale
  const result = await post("/next", { ...state.next, step: Number($("next-step").value),
                                       temperature, top: 10 });
  if (asked !== state.nextRequest) return;
  $("next-step").max = result.tgt_tokens.length;
  $("next-prefix").textContent = result.step === 0 ? "[BOS]" :
    result.tgt_tokens.slice(0, result.step).join(" ");
  $("next-target").textContent = result.target_piece;
  const list = $("next-pieces");
  list.replaceChildren();
  for (const [piece, probability] of result.pieces) {
    const item = document.createElement("li");
    if (piece === result.target_piece) item.className = "target";
    const name = document.createElement("span");
    name.className = "piece";
    name.textContent = piece;
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${(probability * 20).toFixed(2)}rem`;
    const value = document.createElement("span");
    value.className = "probability";
    value.textContent = probability.toFixed(3);
    item.append(name, bar, value);
    list.append(item);
  }
  list.dataset.temperature = String(temperature);
  list.dataset.step = String(result.step);
}

function nextChanged() {
  showNext().catch((err) => { $("error").textContent = err.message; });
}

function fillPickers() {
  const [layers, heads] = state.attention.shapes[$("kind").value];
  setOptions($("layer"), layers, (i) => `${i + 1}`);
  setOptions($("head"), heads, (i) => `${i + 1}`, "mean of the heads");
}

function setOptions(select, count, label, extra) {
  const previous = select.value;
  select.replaceChildren();
  for (let i = 0; i < count; i++) select.append(new Option(label(i), String(i)));
  if (extra) select.append(new Option(extra, "mean"));
  if ([...select.options].some((o) => o.value === previous)) select.value = previous;
}

// The chosen map as rows of numbers (a head, or the mean of the layer's heads).
function chosenMap() {
  const kind = $("kind").value;
  const layer = state.attention.maps[kind][Number($("layer").value)];
  const head = $("head").value;
  if (head !== "mean") return layer[Number(head)];
  return layer[0].map((row, r) =>
    row.map((_, c) => layer.reduce((sum, h) => sum + h[r][c], 0) / layer.length));
}

// White (0) to deep blue (1) on a square-root scale, as plots.py draws it.
function colour(value) {
  const t = Math.sqrt(Math.min(1, Math.max(0, value)));
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return `rgb(${mix(255, 8)}, ${mix(255, 48)}, ${mix(255, 107)})`;
}

function drawHeatmap() {
  if (!state.attention) return;
  const kind = $("kind").value;
  const [rows, cols] = axes(kind);
  const map = chosenMap();
  const canvas = $("heatmap");
  const ctx = canvas.getContext("2d");
  const font = "13px system-ui, sans-serif";
  ctx.font = font;
  const widest = (tokens) => Math.max(...tokens.map((t) => ctx.measureText(t).width));
  const cell = Math.max(14, Math.min(36, Math.floor(560 / Math.max(rows.length, cols.length))));
  const left = Math.ceil(widest(rows)) + 12;
  const top = Math.ceil(widest(cols)) + 12;
  canvas.width = left + cols.length * cell + 4;
  canvas.height = top + rows.length * cell + 4;
  const step = state.attention.step ?? "served";
  Object.assign(canvas.dataset, { left, top, cell, rows: rows.length, cols: cols.length, kind, step });
  ctx.font = font;
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (let r = 0; r < rows.length; r++) {
    for (let c = 0; c < cols.length; c++) {
      ctx.fillStyle = colour(map[r][c]);
      ctx.fillRect(left + c * cell, top + r * cell, cell, cell);
    }
  }
  ctx.strokeStyle = "#999";
  ctx.strokeRect(left - 0.5, top - 0.5, cols.length * cell + 1, rows.length * cell + 1);
  ctx.fillStyle = "#1b1b1b";
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  rows.forEach((token, r) => ctx.fillText(token, left - 6, top + r * cell + cell / 2));
  cols.forEach((token, c) => {  // keys along the top, written upwards
    ctx.save();
    ctx.translate(left + c * cell + cell / 2, top - 6);
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "left";
    ctx.fillText(token, 0, 0);
    ctx.restore();
  });
}

// The slider over the run's saved steps; its right end is the served model itself.
function showSteps() {
  const slider = $("step");
  $("steps").hidden = state.steps.length === 0;
  slider.max = String(state.steps.length);
  slider.value = slider.max;
  $("step-label").textContent = "served weights";
}

async function changeStep() {
  if (!state.asked) return;
  const at = Number($("step").value);
  const step = at < state.steps.length ? state.steps[at] : null;
  const label = step === null ? "served weights" : `step ${step}`;
  $("step-label").textContent = `${label}…`;
  const request = ++state.stepRequest;  // a later move of the slider wins
  try {
    const result = await post("/attention", { ...state.asked, step });
    if (request !== state.stepRequest) return;
    state.attention = result;
    fillPickers();
    drawHeatmap();
    $("step-label").textContent = label;
    $("error").textContent = "";
  } catch (err) {
    if (request === state.stepRequest) $("error").textContent = err.message;
  }
}

function hover(event) {
  const canvas = $("heatmap");
  if (!state.attention || !canvas.dataset.cell) return;
  const { left, top, cell } = canvas.dataset;
  const c = Math.floor((event.offsetX - left) / cell);
  const r = Math.floor((event.offsetY - top) / cell);
  const kind = $("kind").value;
  const [rows, cols] = axes(kind);
  if (r < 0 || c < 0 || r >= rows.length || c >= cols.length) {
    $("hover").innerHTML = "&nbsp;";
    return;
  }
  const value = chosenMap()[r][c];
  $("hover").textContent = `query “${rows[r]}” (row ${r + 1}) → key “${cols[c]}” ` +
    `(column ${c + 1}): ${value.toFixed(3)}`;
}

function loadPictures() {
  for (const img of $("pictures").querySelectorAll("img[data-src]")) {
    if (!img.src) img.src = img.dataset.src;
  }
}

$("form").addEventListener("submit", translate);
$("prefix").addEventListener("input", prefixChanged);
$("to").addEventListener("change", () => $("form").requestSubmit());
$("temperature").addEventListener("input", nextChanged);
$("next-step").addEventListener("input", nextChanged);
$("source").addEventListener("keydown", (event) => {  // Ctrl+Enter translates
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("form").requestSubmit();
});
$("kind").addEventListener("change", () => { fillPickers(); drawHeatmap(); });
$("layer").addEventListener("change", drawHeatmap);
$("head").addEventListener("change", drawHeatmap);
$("heatmap").addEventListener("mousemove", hover);
$("step").addEventListener("input", changeStep);
$("pictures").addEventListener("toggle", loadPictures);

// On load: the model's description, then the placeholder sentence translated (unless the
// visitor has typed meanwhile), so that every section shows something before the first
// click: the translation, the next pieces, the attention with its layer and head menus.
async function start() {
  await showInfo();
  if ($("source").value.trim() !== "") return;
  $("source").value = $("source").placeholder;
  $("form").requestSubmit();
}
start();
