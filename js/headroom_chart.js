// Drawing of Headroom's live training view: a loss chart and a memory bar with its history, on a plain
// 2D canvas. Hand-written because a charting library would need a CDN or a build step (the package
// ships no network access and no bundler); this file only draws, it knows nothing about ComfyUI.

const COLORS = {
  text: "#d8d8d8",
  dim: "#8a8a8a",
  grid: "rgba(255,255,255,0.08)",
  loss: "rgba(110,170,255,0.45)",
  smooth: "#6eaaff",
  validation: "#ffb347",
  allocated: "#5ccf8a",
  reserved: "rgba(92,207,138,0.35)",
  peak: "#ff6b6b",
  barBack: "rgba(255,255,255,0.06)",
};
const FONT = "11px sans-serif";
const SMOOTHING = 0.8; // EMA weight of the smoothed loss line: raw per-step loss is noisy by nature

export function formatBytes(bytes) {
  if (bytes == null) return "–";
  if (bytes >= 1024 ** 3) return `${(bytes / 1024 ** 3).toFixed(2)} GB`;
  return `${(bytes / 1024 ** 2).toFixed(0)} MB`;
}

export function formatSeconds(seconds) {
  if (seconds == null || !isFinite(seconds)) return "–";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

function formatLoss(value) {
  if (value == null || !isFinite(value)) return "–";
  return Math.abs(value) >= 0.01 ? value.toFixed(4) : value.toExponential(2);
}

function exponentialMovingAverage(values) {
  const smoothed = [];
  let average = null;
  for (const value of values) {
    average = average === null ? value : SMOOTHING * average + (1 - SMOOTHING) * value;
    smoothed.push(average);
  }
  return smoothed;
}

function finiteRange(...series) {
  let low = Infinity;
  let high = -Infinity;
  for (const values of series) {
    for (const value of values) {
      if (value == null || !isFinite(value)) continue;
      low = Math.min(low, value);
      high = Math.max(high, value);
    }
  }
  if (low === Infinity) return [0, 1];
  // Losses here are never negative (mse, l1, huber): padding never takes the axis below 0.
  const floor = low >= 0 ? 0 : -Infinity;
  if (high - low < 1e-12) return [Math.max(low - 0.5 * Math.abs(low || 1), floor), high + 0.5 * Math.abs(high || 1)];
  const pad = 0.05 * (high - low);
  return [Math.max(low - pad, floor), high + pad];
}

function polyline(ctx, xs, ys, toX, toY, color, width) {
  ctx.strokeStyle = color;
  ctx.lineWidth = width;
  ctx.beginPath();
  let started = false;
  let drawn = 0;
  for (let i = 0; i < xs.length; i++) {
    if (ys[i] == null || !isFinite(ys[i])) continue;
    const x = toX(xs[i]);
    const y = toY(ys[i]);
    if (started) ctx.lineTo(x, y);
    else ctx.moveTo(x, y);
    started = true;
    drawn++;
  }
  // A single point is an invisible zero-length line: draw it as a dot.
  if (drawn === 1) ctx.arc(toX(xs.at(-1)), toY(ys.at(-1)), width + 1, 0, 2 * Math.PI);
  ctx.stroke();
  return drawn;
}

// One line of numbers above the chart: where the run is, and how fast.
function drawHeader(ctx, run, width) {
  ctx.fillStyle = COLORS.text;
  ctx.font = "bold " + FONT;
  const progress = run.total_steps ? `${run.step}/${run.total_steps}` : `${run.step ?? 0}`;
  ctx.fillText(`${run.run || "run"}  step ${progress}`, 0, 12);
  ctx.font = FONT;
  ctx.fillStyle = COLORS.dim;
  const lr = run.lr == null ? "–" : run.lr.toExponential(1);
  const speed = run.s_per_step == null ? "–" : `${run.s_per_step.toFixed(2)} s/step`;
  const text = `loss ${formatLoss(run.loss.at(-1))}  lr ${lr}  ${speed}  ETA ${formatSeconds(run.eta_s)}`;
  ctx.fillText(text, 0, 27, width);
}

// Loss per step (faint), its moving average (bold) and validation loss (dots); x spans the whole run.
function drawLossChart(ctx, run, left, top, width, height) {
  const [low, high] = finiteRange(run.loss, run.val_loss);
  ctx.canvas.dataset.lossAxis = `${low} ${high}`; // for tests: the loss axis drawn
  const firstStep = run.steps.length ? Math.min(run.steps[0], run.val_steps[0] ?? Infinity) : 0;
  const lastStep = Math.max(run.total_steps || 0, run.steps.at(-1) ?? 1, run.val_steps.at(-1) ?? 1);
  const span = Math.max(lastStep - firstStep, 1);
  const toX = (step) => left + ((step - firstStep) / span) * width;
  const toY = (value) => top + height - ((value - low) / (high - low)) * height;

  ctx.fillStyle = COLORS.barBack;
  ctx.fillRect(left, top, width, height);
  ctx.strokeStyle = COLORS.grid;
  ctx.lineWidth = 1;
  for (let i = 1; i < 4; i++) {
    const y = Math.round(top + (i * height) / 4) + 0.5;
    ctx.beginPath();
    ctx.moveTo(left, y);
    ctx.lineTo(left + width, y);
    ctx.stroke();
  }
  ctx.fillStyle = COLORS.dim;
  ctx.font = FONT;
  ctx.fillText(formatLoss(high), left + 3, top + 11);
  ctx.fillText(formatLoss(low), left + 3, top + height - 3);
  ctx.textAlign = "right";
  ctx.fillText(`step ${lastStep}`, left + width - 3, top + height - 3);
  ctx.textAlign = "left";

  const drawn = polyline(ctx, run.steps, run.loss, toX, toY, COLORS.loss, 1);
  polyline(ctx, run.steps, exponentialMovingAverage(run.loss), toX, toY, COLORS.smooth, 2);
  drawLegend(ctx, left + width - 3, top + 11, run.val_steps.length > 0);
  ctx.fillStyle = COLORS.validation;
  for (let i = 0; i < run.val_steps.length; i++) {
    if (run.val_loss[i] == null || !isFinite(run.val_loss[i])) continue;
    ctx.beginPath();
    ctx.arc(toX(run.val_steps[i]), toY(run.val_loss[i]), 3, 0, 2 * Math.PI);
    ctx.fill();
  }
  return drawn;
}

// What the lines are: top right of the chart.
function drawLegend(ctx, right, y, validation) {
  const items = [["loss", COLORS.loss], [`smoothed (EMA ${SMOOTHING})`, COLORS.smooth]];
  if (validation) items.push(["validation", COLORS.validation]);
  ctx.font = FONT;
  ctx.textAlign = "right";
  let x = right;
  for (const [label, color] of items.reverse()) {
    ctx.fillStyle = COLORS.dim;
    ctx.fillText(label, x, y);
    x -= ctx.measureText(label).width + 4;
    ctx.fillStyle = color;
    ctx.fillRect(x - 10, y - 4, 10, 3);
    x -= 18;
  }
  ctx.textAlign = "left";
}

// The memory the trainer reported last (allocated, reserved, peak on a GPU; process RSS on a CPU)
// as a bar, and allocated (or RSS) over the steps as a line under it.
function drawMemory(ctx, run, left, top, width, height) {
  const onGpu = run.allocated.some((value) => value != null);
  const used = onGpu ? run.allocated : run.rss;
  const current = used.findLast((value) => value != null);
  const reserved = onGpu ? run.reserved.findLast((value) => value != null) : null;
  const peak = onGpu ? run.peak.findLast((value) => value != null) : null;
  const scale = Math.max(current ?? 0, reserved ?? 0, peak ?? 0, ...used.filter((value) => value != null)) * 1.1 || 1;

  ctx.font = FONT;
  ctx.fillStyle = COLORS.text;
  const label = onGpu
    ? `VRAM  allocated ${formatBytes(current)}  reserved ${formatBytes(reserved)}  peak ${formatBytes(peak)}`
    : `memory (CPU, process RSS)  ${formatBytes(current)}`;
  ctx.fillText(label, left, top + 10, width);

  const barTop = top + 15;
  const barHeight = 10;
  ctx.fillStyle = COLORS.barBack;
  ctx.fillRect(left, barTop, width, barHeight);
  if (reserved != null) {
    ctx.fillStyle = COLORS.reserved;
    ctx.fillRect(left, barTop, (reserved / scale) * width, barHeight);
  }
  if (current != null) {
    ctx.fillStyle = COLORS.allocated;
    ctx.fillRect(left, barTop, (current / scale) * width, barHeight);
  }
  if (peak != null) {
    ctx.fillStyle = COLORS.peak;
    ctx.fillRect(left + (peak / scale) * width - 1, barTop - 2, 2, barHeight + 4);
  }

  const lineTop = barTop + barHeight + 4;
  const lineHeight = top + height - lineTop;
  if (lineHeight < 8 || run.steps.length < 2) return;
  const firstStep = run.steps[0];
  const span = Math.max((run.steps.at(-1) ?? 1) - firstStep, 1);
  const toX = (step) => left + ((step - firstStep) / span) * width;
  const toY = (value) => lineTop + lineHeight - (value / scale) * lineHeight;
  polyline(ctx, run.steps, used, toX, toY, COLORS.allocated, 1);
}

// Draws the whole view for one run into `canvas` (sized to its CSS box); returns how many loss
// points were drawn, so callers and tests can tell a drawn chart from an empty one.
export function drawTrainingView(canvas, run) {
  const ratio = window.devicePixelRatio || 1;
  const cssWidth = canvas.clientWidth;
  const cssHeight = canvas.clientHeight;
  if (cssWidth < 20 || cssHeight < 20) return 0; // not laid out (yet): a resize redraws it
  if (canvas.width !== Math.round(cssWidth * ratio) || canvas.height !== Math.round(cssHeight * ratio)) {
    canvas.width = Math.round(cssWidth * ratio);
    canvas.height = Math.round(cssHeight * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, cssWidth, cssHeight);
  ctx.textBaseline = "alphabetic";

  if (!run || run.steps.length === 0) {
    ctx.fillStyle = COLORS.dim;
    ctx.font = FONT;
    ctx.fillText("Loss and memory appear here while this node trains.", 0, 14, cssWidth);
    return 0;
  }
  drawHeader(ctx, run, cssWidth);
  let chartTop = 34;
  if (run.note) {
    // Why the last queue trained nothing (e.g. steps below the run's step): said where the user looks.
    ctx.fillStyle = COLORS.validation;
    ctx.fillText(run.note, 0, 42, cssWidth);
    chartTop += 14;
  }
  const memoryHeight = 64;
  const chartHeight = cssHeight - chartTop - memoryHeight - 8;
  const drawn = drawLossChart(ctx, run, 0, chartTop, cssWidth, Math.max(chartHeight, 20));
  drawMemory(ctx, run, 0, cssHeight - memoryHeight, cssWidth, memoryHeight);
  return drawn;
}
