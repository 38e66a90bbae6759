"""Results rows written to CSV, Parquet or JSON (``attnlab results export``).

Pure: no Ray, no store access, no network.
"""

from __future__ import annotations

import pandas as pd

from attnlab.errors import UserError


# ---------------------------------------------------------------------------------------- export
def export(df: pd.DataFrame, path: str, format: str | None = None) -> str:
    """Write rows to ``path`` (a local path or an ``s3://`` / ``gs://`` URI) as Parquet or CSV (``format``
    defaults to the file suffix). Returns the location written."""
    from attnlab.location import Location

    if format is None:
        format = "csv" if str(path).lower().endswith(".csv") else "parquet"
    if format not in ("parquet", "csv"):
        raise UserError(f"--format {format!r}: allowed: parquet, csv")
    target = Location.parse(path, field="--out")
    if format == "csv":
        data = df.to_csv(index=False).encode("utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        buffer = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), buffer)
        data = buffer.getvalue()
    target.parent.write_bytes(target.name, data)
    return target.uri
