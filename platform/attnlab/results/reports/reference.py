"""The paper's published Table 4 (docs/reference-numbers.md#table-4), as a frame and as Markdown.

Pure: no Ray, no store access, no network.
"""

from __future__ import annotations

import pandas as pd

from attnlab.results.reports.rows import format_value, length_label
from attnlab.results.reports.table import _markdown


# docs/reference-numbers.md#table-4: the paper's Table 4 (validation loss, GPT-2 124M trained at 1K, FineWeb).
# (attention, p, [loss at 1K, 2K, 4K, 8K]); p is the sharpening power (None = no sharpening).
PAPER_TABLE4: tuple[tuple[str, float | None, tuple[float, float, float, float]], ...] = (
    ("softmax", None, (3.1911, 4.1662, 5.4513, 6.2823)),
    ("lssa", None, (3.1905, 4.1301, 5.2960, 5.9403)),
    ("sigmoid_ramapuram", None, (3.1935, 7.4554, 11.8355, 14.4995)),
    ("sigmoid_ramapuram_b", None, (3.1930, 6.5830, 8.4679, 9.5939)),
    ("sigmoid_ramapuram_b_l1", None, (3.1849, 4.3470, 5.5544, 6.1846)),
    ("sigmoid_l1", None, (3.2000, 4.3811, 5.8465, 6.5701)),
    ("relu_wortsman", None, (3.2143, 6.2662, 8.4982, 10.3460)),
    ("relu_l1", None, (3.2006, 4.5192, 5.6924, 6.4561)),
    ("relu_shen", None, (3.2155, 6.5573, 8.9072, 10.7266)),
    ("softmax", 3.0, (3.1879, 4.0277, 5.2842, 6.2339)),
    ("sigmoid_l1", 3.0, (3.1841, 3.7387, 4.9286, 5.7450)),
    ("lssar", 3.0, (3.1782, 4.2383, 5.4056, 6.3007)),
    ("softmax", 15.0, (5.3878, 5.9491, 6.5276, 7.0183)),
    ("sigmoid_l1", 15.0, (3.2171, 3.3499, 3.6108, 3.8587)),
    ("lssar", 15.0, (3.1905, 3.1930, 3.2291, 3.3171)),
)


PAPER_TABLE4_LENGTHS = (1024, 2048, 4096, 8192)


# ---------------------------------------------------------------------------------------- reference
def reference_table() -> pd.DataFrame:
    """The paper's Table 4 (docs/reference-numbers.md#table-4) as a DataFrame: attention, p, loss@1024..8192."""
    records = [
        {"attention": name, "p": p, **{f"mean@{L}": v for L, v in zip(PAPER_TABLE4_LENGTHS, values)}}
        for name, p, values in PAPER_TABLE4
    ]
    return pd.DataFrame.from_records(records)


def format_reference_table() -> str:
    """The paper's Table 4 as markdown, to print next to ours (``attnlab results table --reference``)."""
    header = ["attention", "p", *(f"{length_label(L)} ({L // 1024}x)" for L in PAPER_TABLE4_LENGTHS)]
    body = [[name, format_value(p), *(f"{v:.4f}" for v in values)] for name, p, values in PAPER_TABLE4]
    return ("Paper (Gao & Spratling, Table 4): val_loss, GPT-2 124M trained at 1K on FineWeb\n\n"
            + _markdown(header, body))
