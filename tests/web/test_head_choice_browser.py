"""Inspect opened without a layer or head in its URL: the telling head is the one drawn, and its note goes once
the reader picks another head (the note would explain the wrong map)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser


def test_the_opening_head_is_drawn_and_its_note_goes_with_another_head(page, live_server):
    # The built-in model's last query of this prompt reads one earlier character with most of its weight.
    page.goto(live_server + "/?prompt=The%20cat%20sat%20on%20the%20mat&model=builtin")
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
    layer, head = page.get_attribute("#inspect-view", "data-layer"), page.get_attribute("#inspect-view", "data-head")
    assert (layer, head) != ("0", "0")
    assert page.locator("#head-choice").is_visible()
    assert page.inner_text("#head-label").startswith(f"layer {layer} · head {head}")

    page.click("#head-grid .head-cell[data-layer='0'][data-head='0']")
    page.wait_for_function("document.getElementById('head-label').textContent.startsWith('layer 0 · head 0')")
    assert not page.locator("#head-choice").is_visible()
    assert "layer=0" in page.url and "head=0" in page.url  # the reader's choice is in the URL from now on
    assert page.js_errors == []
