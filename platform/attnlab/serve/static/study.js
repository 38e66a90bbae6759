// attnlab serve: the study page's live parts. Polls the page's own JSON endpoints (same origin, nothing else),
// swaps in the server-rendered trials table, draws the training curves and the extrapolation curves with the
// Plotly bundle this server ships, and fetches the results again when the study's results change.
(function () {
  "use strict";
  const cfg = JSON.parse(document.getElementById("page-config").textContent);
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf"];
  const PLOT_CONFIG = {displaylogo: false, responsive: true, showLink: false, showSendToCloud: false};
  const DASHES = ["dash", "dashdot", "longdash", "longdashdot"];   // validation at longer lengths, one per length
  const curves = {};   // trial key -> {label, status, curve}
  const colors = {};   // trial key -> a palette colour, stable across refreshes
  let signature = cfg.signature;
  let results = cfg.results;
  let page = cfg.page || 1;   // the page of the trial list shown (the server clamps it to the last one)
  let pageChanged = false;    // a new page: fetch its trials' whole curves

  function rgba(hex, alpha) {
    const n = parseInt(hex.slice(1), 16);
    return `rgba(${(n >> 16) & 255},${(n >> 8) & 255},${n & 255},${alpha})`;
  }

  function colorOf(key) {
    if (!(key in colors)) colors[key] = PALETTE[Object.keys(colors).length % PALETTE.length];
    return colors[key];
  }

  function setStatus(text) {
    const el = document.getElementById("poll-status");
    if (el) el.textContent = text;
  }

  // ------------------------------------------------------------------------------------ training curves
  function drawLive() {
    const el = document.getElementById("live-curves");
    const keys = Object.keys(curves).filter((k) => curves[k].curve && curves[k].curve.step.length);
    keys.sort((a, b) => (curves[a].status === "running") - (curves[b].status === "running"));
    document.getElementById("live-empty").hidden = keys.length > 0;
    el.hidden = keys.length === 0;
    if (!keys.length) return;
    const traces = [];
    for (const key of keys) {
      const t = curves[key];
      const running = t.status === "running";
      const color = colorOf(key);
      const name = `${t.label} (${t.status})`;
      traces.push({x: t.curve.step, y: t.curve.train_loss, name: name, legendgroup: key, mode: "lines",
                   line: {color: color, width: running ? 2.5 : 1.2}, opacity: running ? 1 : 0.6,
                   hovertemplate: `${t.label}<br>step %{x}<br>train loss %{y:.4f}<extra></extra>`});
      if (t.curve.val_step.length) {
        traces.push({x: t.curve.val_step, y: t.curve.val_loss, name: name + " val", legendgroup: key,
                     showlegend: false, mode: "lines+markers", line: {color: color, dash: "dot", width: 1.5},
                     marker: {size: 6}, opacity: running ? 1 : 0.6,
                     hovertemplate: `${t.label}<br>step %{x}<br>val loss %{y:.4f}<extra></extra>`});
      }
      // validation loss at longer lengths while training (eval.during_training): one line per length
      (t.curve.val_at || []).forEach((s, j) => {
        if (!s.step.length) return;
        traces.push({x: s.step, y: s.val_loss, name: `${t.label} val @${s.length}`, legendgroup: key,
                     mode: "lines+markers", line: {color: color, dash: DASHES[j % DASHES.length], width: 1.5},
                     marker: {size: 5}, opacity: running ? 1 : 0.6,
                     hovertemplate: `${t.label}<br>step %{x}<br>val loss @${s.length} %{y:.4f}<extra></extra>`});
      });
    }
    const layout = {margin: {t: 10, r: 10, b: 45, l: 60}, height: 340, uirevision: "live",
                    xaxis: {title: {text: "training step"}}, yaxis: {title: {text: "loss (nats)"}},
                    legend: {font: {size: 11}}};
    Plotly.react(el, traces, layout, PLOT_CONFIG);
    el.dataset.traces = String(traces.length);
  }

  // ------------------------------------------------------------------------------------ extrapolation curves
  function selection() {
    const out = {};
    document.querySelectorAll("#curve-controls select[data-selector]").forEach((s) => {
      out[s.dataset.selector] = s.value;
    });
    return out;
  }

  function drawExtrapolation() {
    const el = document.getElementById("extrapolation");
    if (!el || !results || !results.curves) return;
    const c = results.curves;
    const chosen = selection();
    const shown = c.series.filter((s) => Object.entries(chosen).every(([col, v]) => v === "*" || s.labels[col] === v));
    const traces = [];
    shown.forEach((s, i) => {
      const color = PALETTE[i % PALETTE.length];
      const extra = Object.entries(chosen).filter(([, v]) => v === "*").map(([col]) => `${col}=${s.labels[col]}`);
      const name = [s.name, ...extra].join(", ");
      const xs = [], ys = [], lo = [], hi = [], text = [];
      s.x.forEach((x, j) => {
        if (!s.n[j] || s.mean[j] === null) return;
        xs.push(x);
        ys.push(s.mean[j]);
        const sd = s.n[j] > 1 && s.std[j] !== null ? s.std[j] : null;
        lo.push(sd === null ? s.mean[j] : s.mean[j] - sd);
        hi.push(sd === null ? s.mean[j] : s.mean[j] + sd);
        text.push(sd === null ? `n=${s.n[j]}` : `± ${sd.toFixed(4)} (n=${s.n[j]})`);
      });
      if (hi.some((v, j) => v !== lo[j])) {
        traces.push({x: xs.concat(xs.slice().reverse()), y: hi.concat(lo.slice().reverse()), fill: "toself",
                     fillcolor: rgba(color, 0.18), line: {width: 0}, hoverinfo: "skip", showlegend: false,
                     legendgroup: name, mode: "lines", name: name + " ± std"});
      }
      traces.push({x: xs, y: ys, text: text, name: name, legendgroup: name, mode: "lines+markers",
                   line: {color: color, width: 2}, marker: {size: 7},
                   hovertemplate: `${name}<br>length %{x}<br>${c.metric} %{y:.4f} %{text}<extra></extra>`});
    });
    const ticks = c.lengths.map((L, j) => c.length_labels[j] + (c.train_len ? `<br>${+(L / c.train_len).toFixed(3)}x` : ""));
    const unit = /loss$/.test(c.metric) ? " (nats)" : "";
    const layout = {margin: {t: 10, r: 10, b: 60, l: 60}, height: 380,
                    xaxis: {type: "log", tickvals: c.lengths, ticktext: ticks, title: {text: "evaluation length (tokens)"}},
                    yaxis: {title: {text: c.metric + unit}}, legend: {font: {size: 11}}, shapes: [], annotations: []};
    if (c.train_len) {
      layout.shapes.push({type: "line", x0: c.train_len, x1: c.train_len, yref: "paper", y0: 0, y1: 1,
                          line: {color: "#888", dash: "dot", width: 1}});
      layout.annotations.push({x: Math.log10(c.train_len), y: 1, yref: "paper", text: "trained", showarrow: false,
                               xanchor: "left", yanchor: "top", font: {size: 10, color: "#666"}});
    }
    Plotly.react(el, traces, layout, PLOT_CONFIG);
    el.dataset.traces = String(traces.length);
  }

  function bindResults() {
    document.querySelectorAll("#curve-controls select[data-selector]").forEach((s) => {
      s.addEventListener("change", drawExtrapolation);
    });
    drawExtrapolation();
  }

  async function refreshResults() {
    const r = await fetch(cfg.api.results + window.location.search, {cache: "no-store"});
    const d = await r.json();
    if (!r.ok) throw new Error(d.error || r.statusText);
    const keep = selection();
    document.getElementById("results").innerHTML = d.html;
    document.querySelectorAll("#curve-controls select[data-selector]").forEach((s) => {
      if (keep[s.dataset.selector] && [...s.options].some((o) => o.value === keep[s.dataset.selector])) {
        s.value = keep[s.dataset.selector];
      }
    });
    results = d.results;
    bindResults();
  }

  // ------------------------------------------------------------------------------------ polling
  // The trial list is paged (the server renders one page): a pager link shows its page here, without reloading.
  let timer = null;
  let inFlight = false;
  let again = false;  // a page was picked while a poll was on its way: poll again at once
  document.getElementById("trials").addEventListener("click", (event) => {
    const link = event.target.closest("a[data-page]");
    if (!link) return;
    event.preventDefault();
    page = parseInt(link.dataset.page, 10) || 1;
    pageChanged = true;
    const url = new URL(window.location.href);
    url.searchParams.set("page", String(page));
    window.history.replaceState(null, "", url);
    if (inFlight) {
      again = true;
    } else {
      window.clearTimeout(timer);
      poll();
    }
  });

  async function poll(first) {
    inFlight = true;
    try {
      const asked = page;
      const all = first === true || pageChanged;
      const r = await fetch(`${cfg.api.trials}?curves=${all ? "all" : "running"}&page=${asked}`, {cache: "no-store"});
      const d = await r.json();
      if (!r.ok) throw new Error(d.error || r.statusText);
      if (asked !== page) return;  // another page was picked meanwhile: the next poll shows it
      if (pageChanged) {
        pageChanged = false;
        for (const key of Object.keys(curves)) delete curves[key];  // the curves drawn are this page's trials'
      }
      page = d.page;
      document.getElementById("trials").innerHTML = d.html;
      for (const t of d.trials) {
        if (t.curve) curves[t.key] = {label: t.label, status: t.status, curve: t.curve};
        else if (curves[t.key]) curves[t.key].status = t.status;
      }
      drawLive();
      if (d.signature !== signature) {
        signature = d.signature;
        await refreshResults();
      }
      setStatus(`updated ${new Date().toLocaleTimeString()}; ${d.running} trial(s) running`);
    } catch (e) {
      setStatus(`could not refresh: ${e.message || e}`);
    } finally {
      inFlight = false;
      if (again) {
        again = false;
        poll();
      } else {
        timer = window.setTimeout(poll, cfg.refresh_ms);
      }
    }
  }

  bindResults();
  poll(true);
})();
