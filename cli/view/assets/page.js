/* decodelab trace page: draws one command's JSON (embedded in script#trace) with no server and no network.
   Every number shown is read from that JSON: tables show 4 significant digits with the exact value on hover (and
   everywhere with "exact numbers"); the panel of the item under the pointer or the focus shows exact values.
   Numbers the page derives (exp of a log-probability) are labelled as derived. */
"use strict";
(function () {
  const started = performance.now();
  const DOC = JSON.parse(document.getElementById("trace").textContent);
  const PAGE = JSON.parse(document.getElementById("page").textContent);
  const content = document.getElementById("content");
  const detail = document.getElementById("detail");

  // --- text and numbers -------------------------------------------------------------------------------------
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);
  const exact = (v) => (v === null || v === undefined ? "null" : typeof v === "object" ? JSON.stringify(v) : String(v));
  function short(v) {
    if (typeof v !== "number" || Number.isInteger(v)) return exact(v);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
    return String(Number(v.toPrecision(4)));
  }
  /* a number in a table: rounded, the exact JSON value in .x (shown with "exact numbers") and as a tooltip */
  function n(v) {
    const x = esc(exact(v));
    if (typeof v !== "number" || Number.isInteger(v)) return `<span class="n" data-v="${x}">${x}</span>`;
    return `<span class="n" data-v="${x}" title="${x}"><span class="s">${short(v)}</span><span class="x">${x}</span></span>`;
  }
  /* a number in a panel: exact, as the JSON holds it */
  const nx = (v) => `<span class="n" data-v="${esc(exact(v))}">${esc(exact(v))}</span>`;
  /* a token in the running text: a newline keeps its line break after a visible ↵ (a bare one could not be hovered) */
  const visible = (t) => esc(t).replace(/\n/g, '<span class="nl" aria-hidden="true">↵</span>\n');
  const tok = (t) => `<code class="tok">${esc(JSON.stringify(t))}</code>`;
  const shortTok = (t, width) => { const s = JSON.stringify(t).slice(1, -1); return s.length > width ? s.slice(0, width - 1) + "…" : s; };
  const shell = (w) => (w === "" ? "''" : /^[A-Za-z0-9_@%+=:,.\/-]+$/.test(w) ? w : "'" + w.replace(/'/g, "'\"'\"'") + "'");

  const TEXTS = ["token", "text", "prompt"]; // strings shown exactly, quoted and escaped
  /* rows of label / value for one object; data-f names the JSON field of each value */
  function kv(obj, keys, labels) {
    labels = labels || {};
    const rows = (keys || Object.keys(obj)).filter((k) => k in obj).map((k) => {
      const v = obj[k];
      const cell = v !== null && typeof v === "object" ? `<code>${esc(JSON.stringify(v))}</code>`
        : typeof v === "string" ? (TEXTS.includes(k) ? tok(v) : esc(v)) : nx(v);
      return `<tr><th>${esc(labels[k] || k)}</th><td data-f="${esc(k)}">${cell}</td></tr>`;
    });
    return `<table class="kv">${rows.join("")}</table>`;
  }
  /* a table of records: cols [{k: field, label, fmt(row, i) -> html}], numbers rounded (exact on hover) */
  function table(cols, rows, rowAttr) {
    const head = cols.map((c) => `<th${c.num ? ' class="r"' : ""}>${esc(c.label || c.k)}</th>`).join("");
    const body = rows.map((r, i) => `<tr${rowAttr ? rowAttr(r, i) : ""}>` + cols.map((c) => {
      const v = c.fmt ? c.fmt(r, i) : cell(r[c.k]);
      return `<td data-f="${esc(c.k)}"${c.num ? ' class="r"' : ""}>${v}</td>`;
    }).join("") + "</tr>").join("");
    return `<div class="scroll"><table><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table></div>`;
  }
  function cell(v) {
    if (v === null || v === undefined) return n(v);
    if (typeof v === "number") return n(v);
    if (typeof v === "boolean") return String(v);
    if (typeof v === "string") return esc(v);
    return `<code>${esc(JSON.stringify(v))}</code>`;
  }
  const isRecords = (v) => Array.isArray(v) && v.length > 0 && v.every((x) => x && typeof x === "object" && !Array.isArray(x));
  function recordsTable(rows, limit) {
    limit = limit || 500;
    const keys = [];
    rows.slice(0, limit).forEach((r) => Object.keys(r).forEach((k) => { if (!keys.includes(k)) keys.push(k); }));
    const cut = rows.length > limit ? `<p class="note">the first ${limit} of ${rows.length} rows (the JSON holds them all)</p>` : "";
    return table(keys.map((k) => ({ k, num: typeof rows[0][k] === "number" })), rows.slice(0, limit)) + cut;
  }
  function section(title, html, id) {
    const s = document.createElement("section");
    if (id) s.id = id;
    s.innerHTML = `<h2>${esc(title)}</h2>` + html;
    content.appendChild(s);
    return s;
  }
  const show = (html) => { detail.innerHTML = html; };

  // --- keyboard: one tab stop per list, arrow keys inside it ------------------------------------------------
  function group(box, selector, onShow, onActivate) {
    const items = Array.from(box.querySelectorAll(selector));
    if (!items.length) return null;
    if (!items[0].hasAttribute("data-k")) items.forEach((el, k) => { el.tabIndex = k === 0 ? 0 : -1; el.dataset.k = k; });
    let cur = 0;
    function go(k, focus) {
      k = Math.max(0, Math.min(items.length - 1, k));
      items[cur].tabIndex = -1; cur = k; items[k].tabIndex = 0;
      if (focus) items[k].focus();
      return items[k];
    }
    const itemOf = (e) => { const el = e.target.closest(selector); return el && box.contains(el) ? el : null; };
    box.addEventListener("mouseover", (e) => { const el = itemOf(e); if (el) onShow(el); });
    box.addEventListener("focusin", (e) => { const el = itemOf(e); if (el) { go(+el.dataset.k, false); onShow(el); } });
    box.addEventListener("click", (e) => {
      const el = itemOf(e); if (!el) return;
      go(+el.dataset.k, true); onShow(el); if (onActivate) onActivate(el);
    });
    box.addEventListener("keydown", (e) => {
      const el = itemOf(e); if (!el) return;
      const k = +el.dataset.k;
      const to = { ArrowRight: k + 1, ArrowDown: k + 1, ArrowLeft: k - 1, ArrowUp: k - 1, Home: 0,
        End: items.length - 1, PageDown: k + 20, PageUp: k - 20 }[e.key];
      if (to !== undefined) { e.preventDefault(); go(to, true); }
      else if ((e.key === "Enter" || e.key === " ") && onActivate) { e.preventDefault(); onActivate(el); }
    });
    return { items, go };
  }
  function select(items, el) { items.forEach((x) => x.classList.remove("sel")); el.classList.add("sel"); }

  // --- shading ------------------------------------------------------------------------------------------------
  const ONE_HOT = new Set(PAGE.one_hot || []); // step indices whose processed distribution is one-hot (html.py)
  const SHADES = PAGE.shades; // [[lower bound, name], ...] most likely first, the last bound 0
  function shade(p) {
    if (typeof p !== "number") return "s4";
    for (let i = 0; i < SHADES.length; i++) if (p >= SHADES[i][0] || i === SHADES.length - 1) return "s" + i;
  }
  function legend(label) {
    const cls = SHADES.map((s, i) => {
      const range = i === SHADES.length - 1 ? `p &lt; ${SHADES[i - 1][0]}` : `p &ge; ${s[0]}`;
      return `<span class="swatch s${i}">${range}</span> ${esc(s[1])}`;
    });
    return `<p class="legend" data-legend>${esc(label)} &nbsp; ${cls.join(" · ")} · <span class="swatch s4">dashed</span> no number</p>`;
  }

  // --- the shaded text, one span per token ----------------------------------------------------------------
  /* view: {tokens: [{text, p: {mode: prob}}], modes: {mode: legend label}, mode, before, after, detail(i),
     branch(i) or null, series: [{label, cls, values}] for the plot} */
  function tokenView(title, view) {
    const s = section(title, "", view.id);
    const modes = Object.keys(view.modes);
    let mode = view.mode;
    const controls = modes.length > 1 ? `<div class="controls" role="group" aria-label="shade by">shade by: ` +
      modes.map((m) => `<button type="button" data-mode="${m}" aria-pressed="${m === mode}">${esc(m)} p</button>`).join("") + `</div>` : "";
    const spans = view.tokens.map((t, i) =>
      `<span class="t ${shade(t.p[mode])}${t.text === "" ? " empty" : ""}" role="option" aria-selected="false" tabindex="${i ? -1 : 0}" data-i="${i}" data-k="${i}">${visible(t.text)}</span>`);
    const before = view.before ? `<span class="prompt">${esc(view.before)}</span><span class="mark" aria-hidden="true">▕</span>` : "";
    const after = view.after ? `<span class="prompt">${esc(view.after)}</span>` : "";
    s.insertAdjacentHTML("beforeend", controls + `<div class="legend-box">${legend(view.modes[mode])}</div>` +
      `<div class="tokens" role="listbox" aria-label="${esc(title)}: the tokens; arrow keys move, Enter branches">${before}${spans.join("")}${after}</div>` +
      (view.branch ? `<div class="branch" aria-live="polite"><p class="note">Click a token (or press Enter on it) for the command that branches there.</p></div>` : ""));
    const box = s.querySelector(".tokens");
    const branchBox = s.querySelector(".branch");
    const g = group(box, ".t", (el) => show(view.detail(+el.dataset.i)), (el) => {
      select(g.items, el);
      g.items.forEach((x) => x.setAttribute("aria-selected", "false")); el.setAttribute("aria-selected", "true");
      if (view.branch) branchBox.innerHTML = view.branch(+el.dataset.i);
    });
    s.querySelectorAll("button[data-mode]").forEach((b) => b.addEventListener("click", () => {
      mode = b.dataset.mode;
      s.querySelectorAll("button[data-mode]").forEach((x) => x.setAttribute("aria-pressed", String(x === b)));
      g.items.forEach((el, i) => { el.className = el.className.replace(/\bs\d\b/, shade(view.tokens[i].p[mode])); });
      s.querySelector(".legend-box").innerHTML = legend(view.modes[mode]);
    }));
    if (view.series) plot(s, view.series, view.tokens.length, (i) => g && show(view.detail(i)), (i) => g && g.go(i, true),
      view.plotLabel);
    return g;
  }

  // --- a line plot per position (null = no value: the line breaks) ---------------------------------------
  function plot(where, series, count, onHover, onPick, label, xname) {
    const W = 1000, H = 200;
    const vals = series.flatMap((s) => s.values.filter((v) => typeof v === "number" && isFinite(v)));
    if (!vals.length || count < 1) return;
    let lo = Math.min(...vals), hi = Math.max(...vals);
    if (hi === lo) { hi += 0.5; lo -= 0.5; }
    const x = (i) => (count > 1 ? (i * W) / (count - 1) : W / 2);
    const y = (v) => H - 4 - ((v - lo) / (hi - lo)) * (H - 8);
    const lines = series.map((s) => {
      const parts = []; let cur = [];
      s.values.forEach((v, i) => {
        if (typeof v === "number") cur.push(x(i).toFixed(1) + "," + y(v).toFixed(1));
        else if (cur.length) { parts.push(cur); cur = []; }
      });
      if (cur.length) parts.push(cur);
      return parts.map((p) => p.length === 1 ? `<circle class="${s.cls}" cx="${p[0].split(",")[0]}" cy="${p[0].split(",")[1]}" r="2"/>`
        : `<polyline class="${s.cls}" points="${p.join(" ")}"/>`).join("");
    }).join("");
    const names = series.map((s) => `${esc(s.label)} (${s.cls === "raw" ? "solid" : "dashed"})`).join(", ");
    where.insertAdjacentHTML("beforeend", `<h3>${esc(label || "log-probability per token")}</h3>` +
      `<p class="note">${names}; a gap: no value (null in the JSON)</p><div class="axis"><span>max ${n(hi)}</span></div>` +
      `<svg class="plot" viewBox="0 0 ${W} ${H}" preserveAspectRatio="none" role="img" aria-label="${esc(names)}">${lines}` +
      `<line class="cursor" x1="-10" x2="-10" y1="0" y2="${H}"/></svg><div class="axis"><span>min ${n(lo)}</span><span>${xname || "token"} 0 … ${count - 1}</span></div>`);
    const svg = where.querySelector("svg.plot:last-of-type");
    const cursor = svg.querySelector(".cursor");
    const at = (e) => {
      const r = svg.getBoundingClientRect();
      const i = count > 1 ? Math.round(((e.clientX - r.left) / r.width) * (count - 1)) : 0;
      const k = Math.max(0, Math.min(count - 1, i));
      cursor.setAttribute("x1", x(k)); cursor.setAttribute("x2", x(k));
      return k;
    };
    svg.addEventListener("mousemove", (e) => onHover(at(e)));
    svg.addEventListener("click", (e) => onPick(at(e)));
  }

  // --- branching: the `decodelab sample ... --force STEP=TOKEN` command -----------------------------------
  const BR = PAGE.branch; // {argv, prompt_at, force_at} or null
  function command(force, prompt, extra) {
    const argv = BR.argv.slice();
    if (prompt !== undefined) argv[BR.prompt_at] = prompt;
    const words = (extra || []).concat(...force.map(([s, t]) => ["--force", `${s}=${t}`]));
    argv.splice(BR.force_at, 0, ...words);
    return argv.map(shell).join(" ");
  }
  function cmdBlock(label, cmd, tokenId) {
    return `<div class="alt"><p>${label}</p><pre class="cmd" data-token-id="${tokenId}">${esc(cmd)}</pre>` +
      `<button type="button" data-copy>copy</button></div>`;
  }
  document.addEventListener("click", (e) => {
    const b = e.target.closest("button[data-copy]");
    if (!b) return;
    const text = b.previousElementSibling.textContent;
    const done = () => { b.textContent = "copied"; setTimeout(() => { b.textContent = "copy"; }, 1200); };
    if (navigator.clipboard && navigator.clipboard.writeText) navigator.clipboard.writeText(text).then(done, () => selectText(b.previousElementSibling));
    else selectText(b.previousElementSibling);
  });
  function selectText(el) { const r = document.createRange(); r.selectNodeContents(el); const s = getSelection(); s.removeAllRanges(); s.addRange(r); }

  function sampleBranch(steps) {
    return (i) => {
      const s = steps[i];
      if (!BR) return `<p class="note">This document carries no settings to rerun.</p>`;
      const earlier = steps.filter((x) => x.decided_by === "forced" && x.index < s.index).map((x) => [x.index, x.token_id]);
      let h = `<h3>Branch at step ${s.index}</h3><p class="note">The same seed and settings: every other step keeps its ` +
        `random draws, so steps before ${s.index} are this trace's own${earlier.length ? " (its earlier forced steps included)" : ""}.</p>`;
      const alts = s.alternatives || [];
      const seen = new Set();
      [{ token_id: s.token_id, token: s.token, prob: s.prob, raw_prob: s.raw_prob, own: true }].concat(alts).forEach((a) => {
        if (seen.has(a.token_id)) return;
        seen.add(a.token_id);
        const what = `${a.own ? "this run's token" : "instead"} ${tok(a.token)} (id ${a.token_id}; processed p ${nx(a.prob)}, raw p ${nx(a.raw_prob)})`;
        if (!a.own && !(a.prob > 0)) h += `<p class="note" data-removed="${a.token_id}">${what}: removed by the chain at this step ` +
          `(processed p 0), and <code>--force</code> refuses a token the chain removed.</p>`;
        else h += cmdBlock(what + (a.own ? ": reruns this trace" : ":"), command(earlier.concat([[s.index, a.token_id]])), a.token_id);
      });
      return h;
    };
  }

  // --- sample, stream (generate): steps with alternatives and stages ------------------------------------
  function stepDetail(s) {
    let h = `<h3>step ${nx(s.index)} · position ${nx(s.position)}</h3>` +
      `<table class="kv"><tr><th>token</th><td data-f="token">${tok(s.token)}</td></tr><tr><th>token_id</th><td data-f="token_id">${nx(s.token_id)}</td></tr>` +
      (s.decided_by !== undefined ? `<tr><th>decided_by</th><td data-f="decided_by">${esc(s.decided_by)}</td></tr><tr><th>why</th><td data-f="why">${esc(s.why)}</td></tr>` : "") +
      `</table><table><tr><th></th><th>processed (drawn from)</th><th>raw (model, T = 1)</th></tr>` +
      `<tr><th>probability</th><td data-f="prob">${nx(s.prob)}</td><td data-f="raw_prob">${nx(s.raw_prob)}</td></tr>` +
      `<tr><th>log-probability</th><td data-f="logprob">${nx(s.logprob)}</td><td data-f="raw_logprob">${nx(s.raw_logprob)}</td></tr>` +
      `<tr><th>entropy (nats)</th><td data-f="entropy">${nx(s.entropy)}</td><td data-f="raw_entropy">${nx(s.raw_entropy)}</td></tr>` +
      `<tr><th>rank</th><td>—</td><td data-f="raw_rank">${nx(s.raw_rank)}</td></tr>` +
      `<tr><th>candidates kept</th><td data-f="kept">${nx(s.kept)}</td><td>—</td></tr></table>`;
    if (s.alternatives && s.alternatives.length) {
      /* one-hot (greedy, top-k 1; decided in Python as the terminal decides it): the raw p first, labelled raw */
      const raw = ONE_HOT.has(s.index);
      const cols = raw ? [["raw_prob", "raw p (the model's, T = 1)"], ["prob", "processed p (one-hot)"]] : [["prob", "processed p"], ["raw_prob", "raw p"]];
      h += `<h3>alternatives${raw ? " · raw" : ""}</h3>` +
        (raw ? `<p class="note" data-one-hot>raw: the processed distribution is one-hot here (p 1 for the chosen token, 0 for every other), so the model's raw p carries the information</p>` : "") +
        `<table><tr><th>token</th><th>id</th>${cols.map((c) => `<th>${esc(c[1])}</th>`).join("")}</tr>` +
        s.alternatives.map((a, j) => `<tr data-alt="${j}"${a.token_id === s.token_id ? ' class="mark"' : ""}><td>${tok(a.token)}${a.token_id === s.token_id ? " ◀ chosen" : ""}</td>` +
          `<td data-f="token_id">${nx(a.token_id)}</td>` + cols.map((c) => `<td data-f="${c[0]}">${nx(a[c[0]])}</td>`).join("") + `</tr>`).join("") + `</table>`;
    }
    if (s.stages && s.stages.length) {
      h += `<h3>stages, in order</h3><table><tr><th>stage</th><th>kept</th><th>entropy</th><th>mass removed</th></tr>` +
        s.stages.map((g, j) => `<tr data-stage="${j}"><td data-f="name">${esc(g.name)}</td><td data-f="kept">${nx(g.kept)}</td>` +
          `<td data-f="entropy">${nx(g.entropy)}</td><td data-f="mass_removed">${nx(g.mass_removed)}</td></tr>`).join("") +
        `</table><p class="note">mass removed: the probability, before that stage, of the candidates it removed</p>`;
    }
    if (s.state && Object.keys(s.state).length) h += `<h3>stage state</h3>` + kv(s.state);
    const cacheKeys = ["cache_tokens", "kv_bytes", "evicted", "slots"].filter((k) => k in s);
    if (cacheKeys.length) h += `<h3>cache</h3>` + kv(s, cacheKeys, { slots: "slots [start, end, assigned]", evicted: "evicted [start, end)" });
    return h;
  }
  /* steps whose processed distribution is one-hot: the raw distribution shown in their place, labelled raw */
  function rawWhereOneHot(steps) {
    const shown = steps.filter((s) => ONE_HOT.has(s.index));
    if (!shown.length) return;
    const alts = (s) => (s.alternatives || []).map((a, j) => `${j ? "" : "raw: "}${esc(JSON.stringify(a.token))} ${short(a.raw_prob)}`).join(" · ");
    section("raw distribution where the processed one is one-hot", `<p class="note">At these steps the processed distribution is one-hot (greedy, top-k 1): p 1 for the chosen token, 0 for every other, so each is shown with the model's raw p (its own softmax, T = 1), as the terminal's list marked raw: shows it.</p>` +
      table([{ k: "index", label: "step", num: true }, { k: "token", fmt: (s) => tok(s.token) }, { k: "raw_prob", label: "raw p", num: true },
        { k: "raw_rank", label: "raw rank", num: true }, { k: "raw_entropy", label: "raw entropy (nats)", num: true },
        { k: "alternatives", label: "alternatives (raw p)", fmt: alts }], shown), "raw-one-hot");
  }
  function sampleView(doc) {
    const steps = doc.steps;
    const greedy = doc.selector === "greedy" || (steps.length > 0 && steps.every((s) => ONE_HOT.has(s.index)));
    tokenView("text", {
      id: "tokens",
      tokens: steps.map((s) => ({ text: s.token, p: { processed: s.prob, raw: s.raw_prob } })),
      modes: { processed: "each token shaded by its processed p (the distribution it was drawn from):",
               raw: "each token shaded by its raw p (the model's own softmax, temperature 1):" },
      mode: greedy ? "raw" : "processed",
      before: doc.prompt.text,
      detail: (i) => stepDetail(steps[i]),
      branch: sampleBranch(steps),
      series: [{ label: "raw log-probability", cls: "raw", values: steps.map((s) => s.raw_logprob) },
               { label: "processed log-probability", cls: "processed", values: steps.map((s) => s.logprob) }],
    });
    if (greedy) content.insertAdjacentHTML("beforeend", `<p class="note">${doc.selector === "greedy" ? "greedy" : "one-hot"}: every processed p is 1, so the default shading is raw p</p>`);
    rawWhereOneHot(steps);
  }
  function samplesView(doc) {
    section("samples", table([{ k: "index", num: true }, { k: "seed", num: true }, { k: "text", fmt: (r) => tok(r.text) },
      { k: "length", num: true }, { k: "stop_reason" }, { k: "sum_logprob", label: "sum logp (processed)", num: true },
      { k: "mean_logprob", label: "mean logp (processed)", num: true }, { k: "token_ids" }], doc.samples));
    if (doc.summary && doc.summary.first_tokens) section("first token", table([{ k: "token", fmt: (r) => tok(r.token) },
      { k: "token_id", num: true }, { k: "count", num: true }, { k: "frequency", num: true }], doc.summary.first_tokens));
  }

  // --- score: teacher-forced tokens ---------------------------------------------------------------------
  /* where the scored tokens start in the text: the first token is context (never scored); its text is the
     shortest head after which the scored tokens' texts follow one another exactly (null: they do not) */
  function scoredStart(text, steps) {
    const joined = steps.map((s) => s.token).join("");
    for (let k = 0; k <= text.length; k++) if (text.startsWith(joined, k)) return k;
    return null;
  }
  function scoreView(doc) {
    const steps = doc.steps, text = doc.prompt.text;
    const start = scoredStart(text, steps);
    const offsets = []; let at = start;
    steps.forEach((s) => { offsets.push(at); at += s.token.length; });
    const chain = (doc.chain || []).length > 0;
    const modes = { raw: "each token shaded by exp(raw_logprob) (derived: the model's own probability of it):" };
    if (chain) modes.processed = "each token shaded by exp(logprob) (derived: its probability after the chain):";
    const ref = steps.some((s) => "reference_logprob" in s);
    tokenView("scored text", {
      id: "tokens",
      tokens: steps.map((s) => ({ text: s.token, p: { raw: Math.exp(s.raw_logprob), processed: s.logprob === null ? null : Math.exp(s.logprob) } })),
      modes, mode: "raw",
      before: start === null ? "" : text.slice(0, start),
      after: start === null ? "" : text.slice(at),
      detail: (i) => {
        const s = steps[i];
        return `<h3>position ${nx(s.position)}</h3>` + kv(s, ["token", "token_id", "raw_logprob", "raw_rank", "raw_entropy", "logprob",
          "reference_logprob", "kl", "agree"], { raw_logprob: "raw log-probability", raw_rank: "raw rank", raw_entropy: "raw entropy (nats)",
          logprob: "processed log-probability", reference_logprob: "reference log-probability", kl: "KL(reference || model)" }) +
          `<p class="note">derived: exp(raw_logprob) = ${nx(Math.exp(s.raw_logprob))}</p>`;
      },
      branch: BR && start !== null ? (i) => {
        const s = steps[i], prefix = text.slice(0, offsets[i]);
        if (prefix === "") return `<p class="note">Nothing precedes this token in the text: no prompt to branch from.</p>`;
        return `<h3>Branch at position ${s.position}</h3><p class="note">The text before this token as a prompt (tokenized again: ` +
          `the same ids unless the tokenizer splits it differently; the run's prompt.token_ids show them), then this token forced: ` +
          `step 0 of that run has this position's numbers and lists the alternatives to force instead.</p>` +
          cmdBlock(`continue with ${tok(s.token)} (id ${s.token_id}) forced at step 0, 8 tokens:`, command([[0, s.token_id]], prefix, ["-n", "8"]), s.token_id);
      } : null,
      series: [{ label: "raw log-probability", cls: "raw", values: steps.map((s) => s.raw_logprob) }].concat(
        chain ? [{ label: "processed log-probability", cls: "processed", values: steps.map((s) => s.logprob) }] : [],
        ref ? [{ label: "reference log-probability", cls: "processed", values: steps.map((s) => s.reference_logprob) }] : []),
    });
    if (start === null) content.insertAdjacentHTML("beforeend", `<p class="note">The tokens' texts do not follow one another in the text (a token splits a character), so the text around them is not shown and no branch command is built.</p>`);
  }

  // --- OpenAI completions logprobs (an engine's response, or decodelab -f openai) -----------------------
  function openaiView(doc) {
    const choices = doc.choices ? doc.choices : [{ index: 0, text: null, logprobs: doc }];
    const label = doc.decodelab && doc.decodelab.logprobs ? `decodelab's ${doc.decodelab.logprobs} log-probabilities`
      : "the engine's log-probabilities (the format does not say which distribution: vLLM's default is the model's own, raw)";
    content.insertAdjacentHTML("beforeend", `<p class="note">An OpenAI completions response: ${esc(label)}. It carries no decodelab settings, so no branch command.</p>`);
    choices.forEach((c, ci) => {
      const lp = c.logprobs;
      const tops = lp.top_logprobs || [];
      tokenView(`choice ${c.index !== undefined ? c.index : ci}` + (c.finish_reason ? ` (finish_reason ${c.finish_reason})` : ""), {
        id: `choice-${ci}`,
        tokens: lp.tokens.map((t, i) => ({ text: t, p: { logprob: typeof lp.token_logprobs[i] === "number" ? Math.exp(lp.token_logprobs[i]) : null } })),
        modes: { logprob: `each token shaded by exp(token_logprob) (derived), ${label}:` }, mode: "logprob",
        detail: (i) => {
          let h = `<h3>token ${i}</h3><table class="kv"><tr><th>token</th><td data-f="token">${tok(lp.tokens[i])}</td></tr>` +
            `<tr><th>token_logprob</th><td data-f="token_logprob">${nx(lp.token_logprobs[i])}</td></tr>` +
            (lp.text_offset ? `<tr><th>text_offset</th><td data-f="text_offset">${nx(lp.text_offset[i])}</td></tr>` : "") + `</table>`;
          if (lp.token_logprobs[i] === null) h += `<p class="note">null: no log-probability (an echo's first prompt token has none)</p>`;
          else h += `<p class="note">derived: exp(token_logprob) = ${nx(Math.exp(lp.token_logprobs[i]))}</p>`;
          const top = tops[i];
          if (top) h += `<h3>top_logprobs</h3><table><tr><th>token</th><th>logprob</th><th>exp (derived)</th></tr>` +
            Object.entries(top).map(([t, v], j) => `<tr data-alt="${j}"><td>${tok(t)}</td><td data-f="logprob">${nx(v)}</td><td>${nx(Math.exp(v))}</td></tr>`).join("") + `</table>`;
          return h;
        },
        branch: null,
        series: [{ label: "token_logprob", cls: "raw", values: lp.token_logprobs }],
      });
    });
    if (doc.usage) section("usage", kv(doc.usage));
  }

  // --- stream: generate (steps + slot map), score (spans), compare (policies), attention ---------------
  function slotMap(doc) {
    const steps = doc.steps;
    const maxPos = Math.max(1, ...steps.flatMap((s) => (s.slots || []).map((r) => r[1])));
    const W = 1000, rowH = Math.max(0.2, Math.min(14, 420 / steps.length)), H = rowH * steps.length;
    const rects = steps.map((s, i) => (s.slots || []).map((r) =>
      `<rect class="run" x="${((r[0] / maxPos) * W).toFixed(2)}" y="${(i * rowH).toFixed(2)}" width="${Math.max(0.5, ((r[1] - r[0]) / maxPos) * W).toFixed(2)}" height="${Math.max(0.2, rowH * 0.8).toFixed(2)}"/>`).join("")).join("");
    const s = section("slot map: the positions the cache holds at each step",
      `<p class="note">one row per step (top: step 0), x: original positions 0 … ${maxPos}; a filled run is held ` +
      `(the panel lists each run as [start, end, assigned start]); blank is evicted. Hover a row for its numbers.</p>` +
      `<svg class="plot slots" viewBox="0 0 ${W} ${H}" preserveAspectRatio="none" style="height:${Math.max(120, Math.min(440, H + 20))}px" role="img" aria-label="slot map">${rects}</svg>`);
    const svg = s.querySelector("svg");
    svg.addEventListener("mousemove", (e) => {
      const r = svg.getBoundingClientRect();
      const i = Math.max(0, Math.min(steps.length - 1, Math.floor(((e.clientY - r.top) / r.height) * steps.length)));
      show(stepDetail(steps[i]));
    });
  }
  function streamView(doc) {
    if (doc.mode === "generate") { sampleView(doc); slotMap(doc); return; }
    if (doc.mode === "score") {
      section("spans", table(["start", "end", "tokens", "perplexity", "cache_tokens", "kv_bytes", "tokens_per_s"].map((k) => ({ k, num: true })), doc.steps));
      const s = content.lastElementChild;
      plot(s, [{ label: "raw perplexity per span", cls: "raw", values: doc.steps.map((c) => c.perplexity) }], doc.steps.length,
        (i) => show(`<h3>span ${i}</h3>` + kv(doc.steps[i])), (i) => show(`<h3>span ${i}</h3>` + kv(doc.steps[i])), "raw perplexity per span", "span");
      return;
    }
    if (doc.mode === "compare") {
      const rows = doc.policies.map((p) => Object.assign({ label: p.label, spec: p.spec, skipped: p.skipped }, p.summary ? scalars(p.summary) : {}));
      section("policies", recordsTable(rows));
      return;
    }
    if (doc.mode === "attention") {
      const a = doc.attention;
      const layers = [...new Set(a.map((r) => r.layer))], heads = [...new Set(a.map((r) => r.head))];
      const at = new Map(a.map((r) => [r.layer + ":" + r.head, r]));
      const max = Math.max(...a.map((r) => r.ratio || 0), 1e-9);
      const grid = `<div class="scroll"><table class="grid"><tr><th>layer \\ head</th>${heads.map((h) => `<th>${h}</th>`).join("")}</tr>` +
        layers.map((l) => `<tr><th>${l}</th>` + heads.map((h) => { const r = at.get(l + ":" + h); return `<td data-f="ratio" style="background: rgba(179,83,0,${r ? (r.ratio / max).toFixed(3) : 0})">${r ? n(r.ratio) : ""}</td>`; }).join("") + `</tr>`).join("") +
        `</table></div>`;
      section("attention-sink ratio per layer and head", `<p class="note">sink_mass / average_mass (1: an ordinary position)</p>` + grid + recordsTable(a));
    }
  }

  // --- beam: the search tree, hypotheses, the length-penalty sweep -------------------------------------
  function beamView(doc) {
    const steps = doc.steps;
    const colW = 130, rowH = 26, left = 90;
    const nodes = []; // {t, c (candidate), x, y, parentNode}
    const beamNode = []; // per step: beam row -> node index
    steps.forEach((st, t) => {
      const sorted = st.candidates.slice().sort((a, b) => a.rank - b.rank);
      beamNode[t] = {};
      sorted.forEach((c, r) => {
        const parent = t === 0 ? -1 : (beamNode[t - 1][c.parent] !== undefined ? beamNode[t - 1][c.parent] : -1);
        nodes.push({ t, c, x: left + t * colW, y: 14 + r * rowH, parent });
      });
      st.beams.forEach((b) => {
        const last = b.token_ids[b.token_ids.length - 1];
        const k = nodes.findIndex((nd) => nd.t === t && nd.c.fate === "live" && nd.c.parent === b.parent && nd.c.token_id === last);
        if (k >= 0) { beamNode[t][b.beam] = k; nodes[k].beam = b; }
      });
    });
    const height = 14 + Math.max(1, ...steps.map((s) => s.candidates.length)) * rowH;
    const width = left + steps.length * colW + 10;
    const mark = { live: "●", finished: "✓", rejected: "✗", pruned: "–" };
    const edges = nodes.map((nd) => {
      const px = nd.parent < 0 ? left - 40 : nodes[nd.parent].x + 110, py = nd.parent < 0 ? height / 2 : nodes[nd.parent].y;
      return `<path class="edge" d="M${px},${py} C${px + 10},${py} ${nd.x - 10},${nd.y} ${nd.x},${nd.y}"/>`;
    }).join("");
    const boxes = nodes.map((nd, k) => `<g class="node ${nd.c.fate}" data-n="${k}" role="button" aria-label="step ${nd.t} rank ${nd.c.rank} ${esc(JSON.stringify(nd.c.token))} ${nd.c.fate}">` +
      `<rect x="${nd.x}" y="${nd.y - 10}" width="110" height="20" rx="3"/><text x="${nd.x + 4}" y="${nd.y + 4}">${mark[nd.c.fate] || "?"} ${esc(shortTok(nd.c.token, 12))}</text></g>`).join("");
    const s = section("search tree",
      `<p class="note">columns: steps; in each, the step's candidates by rank. ● live (a beam), ✓ finished (entered the pool), ✗ rejected (finished, pool better), – pruned. Each joins the beam it extends; the leftmost point is the prompt.</p>` +
      `<div class="scroll"><svg class="tree" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}">` +
      `<text x="4" y="${height / 2 + 4}">prompt</text>${edges}${boxes}</svg></div>`);
    const box = s.querySelector("svg.tree");
    const g = group(box, "g.node", (el) => {
      const nd = nodes[+el.dataset.n];
      show(`<h3>step ${nd.t} · candidate rank ${nd.c.rank}</h3>` + kv(nd.c, null, { logprob: "logprob (processed step)", raw_logprob: "raw logprob (model)",
        sum_logprob: "sum_logprob (processed, running)", score: "score (sum / norm(length))" }) +
        (nd.beam ? `<h3>beam ${nd.beam.beam} after step ${nd.t}</h3>` + kv(nd.beam, ["text", "token_ids", "sum_logprob", "raw_sum_logprob", "score"]) : ""));
    }, (el) => select(g.items, el));
    const hyp = doc.hypotheses || [];
    section("finished hypotheses", table([{ k: "rank", num: true }, { k: "text", fmt: (r) => tok(r.text) }, { k: "length", num: true },
      { k: "sum_logprob", label: "sum logp (processed)", num: true }, { k: "raw_sum_logprob", label: "sum logp (raw)", num: true },
      { k: "score", num: true }, { k: "step", num: true }, { k: "reason" }, { k: "token_ids" }], hyp) +
      `<p class="note">score = sum_logprob / norm(length) under --length-norm ${esc(String((doc.config || {}).length_norm || "(see config)"))}, length penalty ${esc(exact((doc.config || {}).length_penalty))}</p>`);
    if (doc.sweep) section("length-penalty sweep: the winner under each penalty", table([{ k: "length_penalty", num: true },
      { k: "changed", fmt: (r) => (r.changed ? "◆ the winner changes here" : "") }, { k: "winner.text", label: "winner", fmt: (r) => tok(r.winner.text) },
      { k: "winner.length", label: "length", num: true, fmt: (r) => n(r.winner.length) }, { k: "winner.score", label: "score", num: true, fmt: (r) => n(r.winner.score) },
      { k: "winner.sum_logprob", label: "sum logp", num: true, fmt: (r) => n(r.winner.sum_logprob) }, { k: "stop_reason" }, { k: "steps", num: true }], doc.sweep,
      (r) => (r.changed ? ' class="mark"' : "")));
  }

  // --- speculate: rounds of drafts -----------------------------------------------------------------------
  function specView(doc) {
    const rounds = doc.steps;
    const extraOf = (r) => r.correction || r.bonus || r.plain || null;
    const html = rounds.map((r, ri) => {
      const chips = r.proposed.map((p, j) => {
        const cls = !p.reached ? "unr" : p.accepted ? "acc" : "rej";
        const m = !p.reached ? "·" : p.accepted ? "✓" : "✗";
        return `<span class="chip ${cls}" data-r="${ri}" data-j="${j}">${m} ${esc(shortTok(p.token, 16))}</span>`;
      }).join("");
      const x = extraOf(r);
      const extra = x ? `<span class="chip extra" data-r="${ri}" data-j="x">+${x.kind === "correction" ? "correction" : x.kind}: ${esc(shortTok(x.token, 16))}${x.emitted === false ? " (not emitted)" : ""}</span>` : "";
      return `<tr><td class="r">${r.index}</td><td class="r">${r.position}</td><td class="r" data-f="accepted">${r.accepted}/${r.drafted}</td><td>${chips}${extra}</td><td>${tok(r.emitted.text)}</td></tr>`;
    }).join("");
    const s = section("rounds",
      `<p class="note">✓ accepted draft, ✗ rejected, · not judged (after the first rejection); + the target's own token: a correction after a rejection, a bonus when all were accepted, plain when nothing was drafted. Verification: ${esc(doc.verification)}, draft ${esc(doc.draft)}, gamma ${esc(exact(doc.gamma))}.</p>` +
      `<div class="scroll"><table class="rounds"><thead><tr><th>round</th><th>position</th><th>accepted</th><th>drafts, then the target's token</th><th>emitted</th></tr></thead><tbody>${html}</tbody></table></div>`);
    const box = s.querySelector("table.rounds");
    const labels = { q: "q (draft, processed)", p: "p (target, processed)", u: "u (the uniform drawn)", accept_prob: "accept_prob = min(1, p/q)",
      raw_q: "raw_q (draft model's own)", raw_p: "raw_p (target model's own)" };
    const g = group(box, ".chip", (el) => {
      const r = rounds[+el.dataset.r];
      if (el.dataset.j === "x") {
        const x = extraOf(r);
        show(`<h3>round ${r.index}: ${esc(x.kind)}</h3>` + kv(x, ["kind", "token", "token_id", "prob", "p", "raw_p", "emitted"],
          { prob: "prob (in the distribution drawn from)", p: "p (target, processed)", raw_p: "raw_p (target's own)" }) +
          (x.top ? `<h3>most likely there</h3>` + table([{ k: "token", fmt: (t) => tok(t.token) }, { k: "token_id", num: true }, { k: "prob", num: true }, { k: "p", num: true }, { k: "raw_p", num: true }], x.top) : ""));
      } else {
        const p = r.proposed[+el.dataset.j];
        show(`<h3>round ${r.index}, draft ${+el.dataset.j}</h3>` + kv(p, ["token", "token_id", "q", "p", "u", "accept_prob", "accepted", "reached", "raw_q", "raw_p"], labels) +
          `<p class="note">${p.reached ? (p.accepted ? "accepted: u < accept_prob" : "rejected: u ≥ accept_prob") : "not judged: an earlier draft of the round was rejected"}</p>` +
          kv(r, ["draft_ms", "target_ms"]));
      }
    }, (el) => select(g.items, el));
    if (doc.sweep) section("gamma sweep", recordsTable(doc.sweep.map(scalars)) + (doc.best_gamma !== undefined ? `<p>best gamma (measured): ${nx(doc.best_gamma)}</p>` : ""));
  }

  // --- compare: rows aligned by step, the first divergence of each pair ---------------------------------
  function compareView(doc) {
    const groups = new Map();
    doc.rows.forEach((r, i) => { const k = r.prompt + "\u0000" + r.seed; if (!groups.has(k)) groups.set(k, []); groups.get(k).push(i); });
    const prompts = new Map((doc.prompts || []).map((p) => [String(p.id), p.text]));
    const own = new Map((doc.prompts || []).filter((p) => p.settings).map((p) => [String(p.id), p.settings]));
    let html = `<p class="note">Token ids by step (compare keeps ids, not token texts); each row against the first: a bold underlined id differs from the first row's at that step; ◆ marks the pair's first divergence (the deciding stage in the pairs table below).</p>`;
    groups.forEach((idx, key) => {
      const [prompt, seed] = key.split("\u0000");
      const rows = idx.map((i) => doc.rows[i]);
      const ref = rows[0];
      const len = Math.max(...rows.map((r) => r.token_ids.length));
      const div = new Map();
      doc.pairs.filter((p) => String(p.prompt) === prompt && String(p.seed) === seed && p.a === ref.variant).forEach((p) => div.set(p.b, p));
      html += `<h3>prompt ${esc(prompt)} ${prompts.has(prompt) ? tok(prompts.get(prompt)) : ""}, seed ${esc(seed)}</h3>` +
        (own.has(prompt) ? `<p class="note" data-own-settings>this prompt's own settings, which every variant ran with here over its own values: <code>${esc(JSON.stringify(own.get(prompt)))}</code></p>` : "") +
        `<div class="scroll"><table class="grid"><tr><th>variant</th>` +
        Array.from({ length: len }, (_, j) => `<th>${j}</th>`).join("") + `<th>text</th></tr>` +
        rows.map((r, ri) => {
          const p = div.get(r.variant);
          const cells = Array.from({ length: len }, (_, j) => {
            const v = r.token_ids[j];
            const diff = ri > 0 && v !== ref.token_ids[j];
            const here = p && p.first_divergence === j;
            return `<td class="${diff ? "diff" : ""}${here ? " div" : ""}" data-row="${idx[ri]}" data-j="${j}"${here ? ` title="${esc(p.deciding_stage + ": " + p.why)}"` : ""}>${here ? "◆" : ""}${v === undefined ? "" : v}</td>`;
          }).join("");
          return `<tr><th>${esc(r.variant)}</th>${cells}<td>${tok(r.text)}</td></tr>`;
        }).join("") + `</table></div>`;
      const marks = rows.slice(1).map((r) => div.get(r.variant)).filter(Boolean);
      if (marks.length) html += `<ul class="divergence">` + marks.map((p) => p.first_divergence === null
        ? `<li>${esc(p.b)}: the same tokens as ${esc(p.a)}</li>`
        : `<li>${esc(p.b)} against ${esc(p.a)}: ◆ first divergence at step <b data-f="first_divergence">${p.first_divergence}</b>, deciding stage <b data-f="deciding_stage">${esc(p.deciding_stage)}</b>: ${esc(p.why)}</li>`).join("") + `</ul>`;
    });
    const s = section("rows, aligned by step", html);
    const g = group(s, "td[data-row]", (el) => {
      const r = doc.rows[+el.dataset.row], j = +el.dataset.j;
      const pairs = doc.pairs.filter((p) => String(p.prompt) === String(r.prompt) && p.seed === r.seed && (p.a === r.variant || p.b === r.variant));
      show(`<h3>${esc(r.variant)}, step ${j}</h3>` + kv({ token_id: r.token_ids[j] === undefined ? null : r.token_ids[j], decided_by: (r.decided_by || [])[j] === undefined ? null : r.decided_by[j] }) +
        pairs.map((p) => `<h3>pair ${esc(p.a)} / ${esc(p.b)}</h3>` + kv(p, ["first_divergence", "deciding_stage", "why", "a_token", "b_token", "a_token_text", "b_token_text", "a_after", "b_after"])).join(""));
    }, (el) => select(g.items, el));
    section("pairs: the first divergence and what decided it", table(["a", "b", "prompt", "seed", "first_divergence", "deciding_stage", "why", "a_token_text", "b_token_text", "a_after", "b_after"]
      .map((k) => ({ k, num: ["seed", "first_divergence", "a_token", "b_token"].includes(k) })), doc.pairs));
    section("rows", table(["variant", "method", "prompt", "seed", "length", "stop_reason", "mean_logprob", "raw_perplexity", "distinct_1", "distinct_2",
      "repetition_rate", "mean_kept", "mean_entropy", "tokens_per_s"].map((k) => ({ k, num: !["variant", "method", "prompt", "stop_reason"].includes(k) }))
      .concat([{ k: "text", fmt: (r) => tok(r.text) }]), doc.rows) + `<p class="note">mean_logprob: processed; raw_perplexity: the model's own</p>`);
    section("variants", table([{ k: "name" }, { k: "method" }, { k: "spec" }], doc.variants));
  }

  // --- batch: the iteration timeline --------------------------------------------------------------------
  function batchView(doc) {
    const its = doc.iterations, reqs = doc.requests;
    const ids = reqs.map((r) => String(r.id));
    const state = new Map(ids.map((id) => [id, "wait"]));
    const glyph = ids.map(() => []);
    const mismatch = [];
    its.forEach((it, t) => {
      const joined = new Set(it.joined.map(String)), fin = new Set(it.finished.map(String)), pre = new Set(it.preempted.map(String));
      joined.forEach((id) => state.set(id, "run"));
      let running = 0;
      ids.forEach((id, k) => {
        let gl = "";
        if (pre.has(id)) gl = "P";
        else if (state.get(id) === "run") { gl = joined.has(id) ? "J" : fin.has(id) ? "F" : "■"; running++; }
        else if (state.get(id) === "wait") gl = "·";
        glyph[k].push(gl);
      });
      pre.forEach((id) => state.set(id, "wait"));
      fin.forEach((id) => state.set(id, "done"));
      if (running !== it.running) mismatch.push(it.index);
    });
    const head = its.map((it, t) => `<th data-it="${t}" class="itcol">${it.index}</th>`).join("");
    const rows = ids.map((id, k) => `<tr><th>${esc(id)}</th>` + glyph[k].map((gl, t) => `<td data-it="${t}" data-req="${k}">${gl}</td>`).join("") + `</tr>`).join("");
    const s = section("iteration timeline",
      `<p class="note">rows: requests; columns: iterations (one forward each). J joined, ■ ran, F finished (its last token), P preempted (blocks freed, back to the queue), · waiting; derived from each iteration's joined, finished and preempted lists. Hover a column for the iteration's numbers.</p>` +
      (mismatch.length ? `<p class="note">the derived count of running requests differs from the JSON's running at iterations ${mismatch.join(", ")}</p>` : "") +
      `<div class="scroll"><table class="grid timeline"><tr><th>request \\ iteration</th>${head}</tr>${rows}</table></div>`);
    const itDetail = (t, k) => `<h3>iteration ${its[t].index}</h3>` + kv(its[t]) + (k !== undefined ? `<h3>request ${esc(ids[k])}</h3>` + kv(reqs[k], ["prompt", "text", "stop_reason", "prefix_hit_tokens", "computed_tokens", "preemptions", "joined", "finished"]) : "");
    const box = s.querySelector("table.timeline");
    box.addEventListener("mouseover", (e) => { const c = e.target.closest("td[data-it]"); if (c) show(itDetail(+c.dataset.it, +c.dataset.req)); });
    group(box, "th.itcol", (el) => show(itDetail(+el.dataset.it)), null);
    section("iterations", recordsTable(its));
    section("requests", table(["id", "prompt", "text", "stop_reason", "prefix_hit_tokens", "computed_tokens", "preemptions", "joined", "finished"]
      .map((k) => ({ k, num: ["prefix_hit_tokens", "computed_tokens", "preemptions", "joined", "finished"].includes(k), fmt: ["prompt", "text"].includes(k) ? (r) => tok(r[k]) : undefined })), reqs));
    reqs.forEach((r, k) => {
      if (!r.steps || !r.steps.length) return;
      /* greedy (every processed p 1: exp(logprob) = 1 at each step): the processed shading is flat, so raw is the default */
      const flat = r.steps.every((st) => st.logprob === 0);
      tokenView(`request ${r.id}`, {
        id: `request-${k}`,
        tokens: r.steps.map((st) => ({ text: st.token, p: { processed: Math.exp(st.logprob), raw: Math.exp(st.raw_logprob) } })),
        modes: { processed: "each token shaded by exp(logprob) (derived: processed p, the distribution drawn from):", raw: "each token shaded by exp(raw_logprob) (derived: the model's own p):" },
        mode: flat ? "raw" : "processed", before: r.prompt,
        detail: (i) => `<h3>request ${esc(String(r.id))}, step ${i}</h3>` + kv(r.steps[i], ["index", "token", "token_id", "logprob", "raw_logprob"],
          { logprob: "processed log-probability", raw_logprob: "raw log-probability" }),
        branch: null,
      });
      if (flat) content.lastElementChild.insertAdjacentHTML("beforeend", `<p class="note" data-one-hot>request ${esc(String(r.id))}: every processed p is 1 (greedy), so the default shading is raw p (the model's own)</p>`);
    });
  }

  // --- probs: the distribution after each stage ---------------------------------------------------------
  function probsView(doc) {
    section("stages", doc.stages.map((st) => `<h3>${esc(st.name)}: kept ${n(st.kept)}, entropy ${n(st.entropy)}, mass removed ${n(st.mass_removed)}</h3>` +
      table([{ k: "token", fmt: (t) => tok(t.token) }, { k: "token_id", num: true }, { k: "logit", num: true }, { k: "prob", num: true }], st.top)).join(""));
    const names = doc.stages.map((s) => s.name);
    section("tokens through the stages", table([{ k: "token", fmt: (t) => tok(t.token) }, { k: "token_id", num: true }, { k: "logit", label: "raw logit", num: true },
      { k: "raw_prob", num: true }].concat(names.map((nm) => ({ k: "p:" + nm, label: `p after ${nm}`, num: true, fmt: (t) => n(t.probs[nm]) })),
      names.map((nm) => ({ k: "rank:" + nm, label: `rank after ${nm}`, num: true, fmt: (t) => n(t.ranks[nm]) }))), doc.tokens) +
      `<p class="note">rank null: removed by that stage</p>`);
    if (doc.given) section("given distribution", kv(doc.given));
  }

  // --- any other document: its summary and its lists -----------------------------------------------------
  function genericView(doc) {
    Object.entries(doc).forEach(([k, v]) => {
      if (["summary", "config", "prompt"].includes(k)) return;
      if (isRecords(v)) section(k, recordsTable(v.map(scalars)));
      else if (v && typeof v === "object" && !Array.isArray(v)) section(k, kv(v));
    });
  }
  function scalars(obj) {
    const out = {};
    Object.entries(obj).forEach(([k, v]) => { out[k] = v; });
    return out;
  }

  // --- the page -------------------------------------------------------------------------------------------
  function header() {
    const d = DOC, parts = [];
    if (PAGE.kind === "openai") {
      parts.push(`<h1>OpenAI completions logprobs${d.model ? " · " + esc(d.model) : ""}</h1>`);
    } else {
      parts.push(`<h1>decodelab ${esc(d.command)}${d.model !== undefined ? " · " + esc(exact(d.model)) : ""}</h1>`);
      const m = [["device", d.device], ["dtype", d.dtype], ["mode", d.mode], ["selector", d.selector], ["format_version", d.format_version === undefined ? 1 : d.format_version]]
        .filter(([, v]) => v !== undefined).map(([k, v]) => `${k} <b data-f="${k}">${esc(exact(v))}</b>`);
      if (Array.isArray(d.chain)) m.push(`chain <b data-f="chain">${d.chain.length ? d.chain.map(esc).join(" → ") : "(none)"}</b>`);
      parts.push(`<p class="meta">${m.join(" · ")}</p>`);
      if (d.prompt && typeof d.prompt.text === "string") {
        const t = d.prompt.text, count = `${t.length} characters, ${(d.prompt.token_ids || []).length} tokens`;
        parts.push(t.length <= 280 ? `<p class="meta">prompt: ${tok(t)} (${count})</p>`
          : `<details class="meta"><summary>prompt: ${tok(t.slice(0, 160))}… (${count}: open for all of it)</summary>${tok(t)}</details>`);
      }
    }
    parts.push(`<div class="controls"><button type="button" id="exact" aria-pressed="false">exact numbers</button>` +
      `<button type="button" id="nocolor" aria-pressed="false">no colour</button>` +
      `<span class="note">tables round to 4 significant digits (the exact value on hover); the summary and the panels show the JSON's exact values</span></div>`);
    content.insertAdjacentHTML("beforeend", parts.join(""));
    [["exact", "exact"], ["nocolor", "nocolor"]].forEach(([id, cls]) => {
      const b = document.getElementById(id);
      b.addEventListener("click", () => { const on = document.body.classList.toggle(cls); b.setAttribute("aria-pressed", String(on)); });
    });
  }
  function summary() {
    const s = DOC.summary;
    if (!s || typeof s !== "object") return;
    const flat = {}, lists = [];
    Object.entries(s).forEach(([k, v]) => { if (isRecords(v)) lists.push([k, v]); else flat[k] = v; });
    section("summary", kv(flat) + lists.map(([k, v]) => `<h3>${esc(k)}</h3>` + recordsTable(v)).join(""), "summary");
  }
  // --- a thinking model's run: the reasoning / answer split (core/trace/reasoning.py, docs/reasoning.md) -----
  function reasoning() {
    const r = DOC.reasoning;
    if (!r || typeof r !== "object") return;
    const one = (x) => Object.entries(x.summary || {}).map(([part, v]) => Object.assign({ part }, v));
    if (Array.isArray(r)) {  // compare: one split per row
      section("reasoning and answer", r.map((x) => `<h3>${esc(`${x.variant} · prompt ${x.prompt} · seed ${x.seed}`)}</h3>` +
        recordsTable(one(x))).join(""), "reasoning");
      return;
    }
    const start = r.answer_starts_at === null || r.answer_starts_at === undefined ? "the thinking never ended"
      : `the answer starts at generated token ${r.answer_starts_at}`;
    const labels = (r.parts || []).map((part, i) => `<span class="part-${esc(part)}" data-part="${esc(part)}" title="token ${i}: ${esc(part)}">${esc(part[0])}</span>`).join("");
    section("reasoning and answer", `<p class="note">${esc(start)} (markers ${esc(JSON.stringify(r.tags))}); per generated token: ` +
      `r reasoning, a answer, m marker, o outside any block</p><p class="parts">${labels}</p>` + recordsTable(one(r)), "reasoning");
  }
  function config() {
    const c = DOC.config;
    if (!c || typeof c !== "object") return;
    const set = {};
    Object.entries(c).forEach(([k, v]) => { if (v !== null && !(Array.isArray(v) && !v.length) && !(typeof v === "object" && !Array.isArray(v) && !Object.keys(v).length)) set[k] = v; });
    content.insertAdjacentHTML("beforeend", `<details><summary>settings (config: the ones set; null and empty ones left out)</summary>${kv(set)}</details>`);
  }

  const VIEWS = { tokens: (d) => (d.command === "score" ? scoreView(d) : d.samples ? samplesView(d) : sampleView(d)), stream: streamView, beam: beamView,
    speculate: specView, compare: compareView, batch: batchView, probs: probsView, generic: genericView, openai: openaiView };
  try {
    header();
    if (PAGE.kind !== "openai") config();
    VIEWS[PAGE.view](DOC);
    reasoning();
    summary();
  } catch (err) {
    content.insertAdjacentHTML("beforeend", `<p class="error" id="page-error">This page could not draw the trace: ${esc(err && err.message)}. The JSON is in the page source (script#trace).</p>`);
    window.decodelabError = String(err && err.stack);
  }
  window.decodelabPage = { drawnMs: performance.now() - started, tokens: document.querySelectorAll(".t").length };
})();
