"""Training lab view data: pure functions from tensors and numbers to plain data (Plotly specs, tables)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from app.training.trainer import TrainConfig, batch_windows
from app.viz.tokens import visible

# The reference article's run (2 layers, 4 heads, d_model 32, AdamW lr 3e-3): loss at steps 0/100/200/300.
ARTICLE_LOSSES = [(0, 3.0856), (100, 0.4779), (200, 0.0615), (300, 0.0312)]
ARTICLE_MAX_DIFF = 4.89e-6  # its cached-vs-full max |Δlogits|


def loss_figure(losses: list[tuple[int, float]], _: Callable[..., str]) -> dict:
    """The loss curve: this run (trace 0, extended live by the page) and the article's four points."""
    return {
        "data": [
            {"x": [s for s, _l in losses], "y": [v for _s, v in losses], "type": "scatter", "mode": "lines",
             "name": _("train.curve.this_run"), "line": {"color": "#2457c5", "width": 2}},
            {"x": [s for s, _l in ARTICLE_LOSSES], "y": [v for _s, v in ARTICLE_LOSSES], "type": "scatter",
             "mode": "markers", "name": _("train.curve.article"), "marker": {"color": "#c2410c", "size": 9,
                                                                             "symbol": "diamond"}},
        ],
        "layout": {
            "margin": {"l": 70, "r": 20, "t": 10, "b": 55},
            "height": 340,
            "xaxis": {"title": {"text": _("train.axis.step")}, "rangemode": "tozero"},
            "yaxis": {"title": {"text": _("train.axis.loss")}, "type": "log",
                      "tickvals": [0.01, 0.03, 0.1, 0.3, 1, 3], "ticktext": ["0.01", "0.03", "0.1", "0.3", "1", "3"]},
            "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.02, "yanchor": "bottom"},
            "font": {"size": 14},
        },
    }


SCRIPT_STRINGS = (
    "train.status.idle", "train.status.ready", "train.status.running", "train.status.stopping",
    "train.status.stopped", "train.status.publishing", "train.status.done", "train.status.failed",
    "train.param.no_grad", "train.param.no_state", "train.param.fused_note", "train.param.rows_cut",
    "train.param.part_q", "train.param.part_k", "train.param.part_v", "train.param.summary",
    "train.status.line", "train.status.stopped_line", "train.status.queued", "train.line.waiting",
    "train.line.waiting.one", "train.line.mine",
    "error.title",
)


def heatmap_figure(matrix: list[list[float]] | None, *, x_title: str, y_title: str, diverging: bool = True,
                   hover: str = "row %{y}, col %{x}") -> dict:
    """One tensor as a heatmap; a diverging scale centred on 0 for signed tensors, sequential otherwise."""
    if matrix is None:
        return {"data": [], "layout": {}}
    peak = max((abs(v) for row in matrix for v in row), default=1.0) or 1.0
    trace: dict[str, object] = {"z": matrix, "type": "heatmap", "hovertemplate": hover + ": %{z:.3g}<extra></extra>"}
    if diverging:
        trace.update(colorscale="RdBu", reversescale=True, zmin=-peak, zmax=peak)
    else:
        trace.update(colorscale="Viridis", zmin=0, zmax=peak)
    return {
        "data": [trace],
        "layout": {
            "margin": {"l": 50, "r": 10, "t": 10, "b": 45},
            "height": 300,
            "xaxis": {"title": {"text": x_title}},
            "yaxis": {"title": {"text": y_title}, "autorange": "reversed"},
        },
    }


def param_figures(view: dict, _: Callable[..., str]) -> dict:
    """Replace a parameter view's raw matrices by one heatmap spec per tensor (v is never negative)."""
    out = {k: v for k, v in view.items() if k != "matrices"}
    out["figures"] = {
        k: heatmap_figure(m, x_title=_("train.param.axis_x"), y_title=_("train.param.axis_y"),
                          hover=_("train.param.hover", row="%{y}", col="%{x}"),
                          diverging=k != "exp_avg_sq")
        for k, m in view["matrices"].items()
    }
    return out


def first_batch(data: torch.Tensor, config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch the trainer draws at step 0 for this config (same generator, same seed)."""
    generator = torch.Generator().manual_seed(config.seed)
    return batch_windows(data, batch_size=config.batch_size, block_size=config.block_size, generator=generator)


@torch.no_grad()
def step_view(model: nn.Module, token_text: Callable[[int], str], data: torch.Tensor, config: TrainConfig,
              *, columns: int = 24) -> dict:
    """Step 0 of the run made concrete: row 0 of its real batch, inputs over targets shifted by one, and the
    shapes of inputs, targets, logits and loss from a real forward of ``model`` on that batch."""
    inputs, targets = first_batch(data, config)  # (B, T), (B, T)
    logits = model(input_ids=inputs).logits  # (B, T, V)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    row_in, row_tg = inputs[0, :columns].tolist(), targets[0, :columns].tolist()
    return {
        "columns": [
            {"pos": i, "input": visible(token_text(a)), "input_id": a, "target": visible(token_text(b)), "target_id": b}
            for i, (a, b) in enumerate(zip(row_in, row_tg, strict=True))
        ],
        "row_length": int(inputs.shape[1]),
        "shapes": {
            "inputs": list(inputs.shape),
            "targets": list(targets.shape),
            "logits": list(logits.shape),
            "loss": list(loss.shape),
        },
        "loss": float(loss),
        "tensors_with_grad": sum(1 for _ in model.parameters()),
    }
