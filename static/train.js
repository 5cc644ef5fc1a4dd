// Training lab: start/stop/resume, the live loss curve, and the parameter/optimizer-state heatmaps.
// Polls /api/train/status (every 500 ms while a run is active, every 2 s otherwise) so every open page
// follows the run training now; this page's own run is followed live through the server's line (kv.follow).
// Server text is inserted with textContent only.
// Everything waits for Plotly, which kv.plotly() loads after the page's first paint.
window.kv.page("train", () => window.kv.plotly().then(() => {
  "use strict";
  const kv = window.kv, $ = kv.$;
  const init = JSON.parse($("train-init").textContent);
  const ACTIVE = ["running", "stopping", "publishing"];
  const fmtShape = (s) => "(" + s.join(", ") + ")";
  const plotCfg = kv.PLOT_CONFIG;

  const plot = $("loss-plot");
  let jobId = init.status.job;
  let seen = init.status.losses.length;
  let status = init.status.status;
  let lastParamStep = -1;
  let paramBusy = false;

  Plotly.newPlot(plot, init.figure.data, init.figure.layout, plotCfg);


  function fire(name) { document.body.dispatchEvent(new CustomEvent(name)); }

  function showStatus(s) {
    const pill = $("train-status");
    pill.dataset.status = s.status;
    pill.textContent = kv.t("train.status." + s.status);
    pill.className = "pill" + (s.status === "done" ? " ok" : s.status === "failed" ? " bad" : "");
    const progress = $("train-progress");
    // A stopped run says where it stopped and what was kept (the served model is left as it was).
    progress.textContent = s.job ? kv.t(s.status === "stopped" ? "train.status.stopped_line" : "train.status.line", {
      step: s.step, steps: s.steps, loss: s.last_loss === null ? "–" : s.last_loss.toFixed(4),
    }) : "";
    if (s.error) kv.showError(s.error);
    // Runs take turns: Start puts this browser's run in line (whoever's run trains now); Stop is for this
    // browser's own run, waiting or training.
    const mine = s.line && s.line.mine;
    $("train-start").disabled = Boolean(mine);
    $("train-stop").disabled = !mine;
    $("train-resume").disabled = s.status !== "stopped" || Boolean(mine);
    if (!following && s.line) {
      const n = s.line.waiting;
      showLine(mine ? lineText(mine) : n ? kv.t("train.line.waiting", { n }) : "");
    }
    const liveStep = $("live-step");
    if (liveStep && s.job) liveStep.textContent = s.step;
  }

  function showLine(text) {
    $("train-line").hidden = !text;
    $("train-line-text").textContent = text;
  }
  /* What this browser's own run says: its place while it waits; nothing while it trains (the status row above
     shows the run in progress, which is then this one); how it ended. */
  function lineText(ev) {
    if (ev.event === "running") return "";
    return ev.event === "queued" ? kv.t("train.line.mine", { text: ev.text }) : ev.text;
  }

  /* This page's own run, followed live through the server's line (kv.follow): its place, then its steps. The
     open connection is what keeps the run: closing the page stops it. */
  let following = null;  // the AbortController of the run this page follows
  async function follow(url, body) {
    if (following) following.abort();
    const me = new AbortController();
    following = me;
    showLine(kv.t("js.lab.sending"));
    let seenEvent = null;
    try {
      await kv.follow(url, body, (ev) => {
        if (following !== me) return;
        showLine(lineText(ev));
        if (ev.event !== seenEvent) { seenEvent = ev.event; schedule(0); }  // it started or ended: read the lab now
      }, me.signal);
    } catch (e) {
      if (following === me && !me.signal.aborted && e.status === undefined) showLine(kv.t("js.lab.lost"));
    } finally {
      if (following === me) following = null;
      schedule(0);
    }
  }

  function apply(s) {
    if (s.job !== jobId) {  // another run started (maybe from another page): start the curve over
      jobId = s.job;
      seen = 0;
      Plotly.restyle(plot, { x: [[]], y: [[]] }, [0]);
      fire("train-job");
      return false;
    }
    if (s.losses.length && s.since === seen) {
      Plotly.extendTraces(plot, { x: [s.losses.map((p) => p[0])], y: [s.losses.map((p) => p[1])] }, [0]);
      seen = s.since + s.losses.length;
    }
    plot.dataset.points = String(seen);
    showStatus(s);
    if (s.status === "done" && status !== "done") fire("train-done");
    // A run that stops or ends leaves new weights: the step panel's "on this batch now" loss is read again.
    if (ACTIVE.includes(status) && !ACTIVE.includes(s.status)) fire("train-settled");
    if (s.step !== lastParamStep && (s.status !== "running" || s.step - lastParamStep >= 10)) showParam();
    status = s.status;
    return true;
  }

  // One polling loop per page: schedule() moves its next tick, it never starts a second loop.
  let timer = null;
  let inFlight = false;
  function schedule(ms) { clearTimeout(timer); timer = setTimeout(poll, ms); }
  async function poll() {
    if (inFlight) return;
    inFlight = true;
    let again = false;
    try {
      again = !apply(await kv.getJSON("/api/train/status?since=" + seen));
    } catch (e) {
      /* the server may be restarting: try again on the next tick */
    } finally {
      inFlight = false;
    }
    schedule(again ? 0 : ACTIVE.includes(status) ? 500 : 2000);
  }

  // --- parameter view --------------------------------------------------------------------------
  async function showParam() {
    if (paramBusy) return;
    paramBusy = true;
    const name = $("param-name").value;
    const part = $("param-part").value;
    try {
      const v = await kv.getJSON("/api/train/param?name=" + encodeURIComponent(name) + "&part=" + part);
      lastParamStep = v.step;
      $("param-summary").textContent = kv.t("train.param.summary", {
        name: v.name + (v.slice || ""), shape: fmtShape(v.shape), view: fmtShape(v.view_shape), step: v.step,
      });
      let note = v.slice ? kv.t("train.param.fused_note", { slice: v.slice, part: kv.t("train.param.part_" + v.part) }) : "";
      if (v.rows_shown < (v.view_shape.length > 1 ? v.view_shape[0] : 1)) note += " " + kv.t("train.param.rows_cut", { n: v.rows_shown });
      $("param-note").textContent = note;
      for (const key of ["value", "grad", "exp_avg", "exp_avg_sq"]) {
        const fig = v.figures[key];
        const div = $("param-plot-" + key);
        const empty = document.querySelector("[data-empty-of='" + key + "']");
        const shape = v.shapes[key];
        document.querySelector("[data-shape-of='" + key + "']").textContent = shape ? fmtShape(shape) : "—";
        if (fig.data.length) {
          empty.hidden = true;
          div.hidden = false;
          Plotly.react(div, fig.data, fig.layout, plotCfg);
        } else {
          Plotly.purge(div);
          div.hidden = true;
          empty.hidden = false;
          empty.textContent = key === "grad" ? kv.t("train.param.no_grad") : kv.t("train.param.no_state");
        }
      }
    } catch (e) {
      // kv.getJSON showed the message
    } finally {
      paramBusy = false;
    }
  }

  // --- commands ---------------------------------------------------------------------------------
  const form = $("train-form");
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    kv.clearError();
    const f = new FormData(form);
    const body = {
      source: f.get("source"), text: f.get("source") === "text" ? f.get("text") : null,
      steps: Number(f.get("steps")), lr: Number(f.get("lr")), batch_size: Number(f.get("batch_size")),
      block_size: Number(f.get("block_size")), seed: Number(f.get("seed")), target: f.get("target"),
    };
    follow("/api/train/jobs", body);
  });
  $("train-stop").addEventListener("click", async () => {
    try { showStatus(await kv.postJSON("/api/train/stop")); } catch (e) { /* kv.postJSON showed the message */ }
    schedule(0);
  });
  $("train-resume").addEventListener("click", () => {
    kv.clearError();
    follow("/api/train/jobs/resume", { steps: Number(new FormData(form).get("steps")) });
  });
  $("train-text").addEventListener("input", () => { $("source-text").checked = true; });
  $("param-show").addEventListener("click", showParam);
  $("param-name").addEventListener("change", showParam);
  $("param-part").addEventListener("change", showParam);

  showStatus(init.status);
  showParam();
  schedule(0);
}));
