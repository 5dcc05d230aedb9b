"""The child's cost of a float32 model's outputs between the device and Redis, for one batch
of `--rows` rows of `--width` values (an embedding model's): the handler's conversion of its
output tensor and `results.stored` packing them, with the rows as Python floats
(`.tolist()`, as before issue 39) or as float32 numpy rows (`output_rows`), in µs a batch
(the best of `--repeat` timings of `--number` batches each).

    python -m bench.rows_cost [--rows 32] [--width 384]

Prints one JSON object."""
from __future__ import annotations

import argparse
import json
import os
import timeit

import torch

from tasks import results
from workers.child.handlers.base import output_rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--number", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    output = torch.randn(a.rows, a.width, generator=torch.Generator().manual_seed(0))
    lists, rows = output.tolist(), output_rows(output)
    assert results.stored("j", outputs=lists) == results.stored("j", outputs=rows)
    timed = {
        "tolist": lambda: output.detach().cpu().tolist(),
        "stored(lists)": lambda: results.stored("j", outputs=lists),
        "tolist+stored": lambda: results.stored("j", outputs=output.detach().cpu().tolist()),
        "output_rows": lambda: output_rows(output),
        "stored(rows)": lambda: results.stored("j", outputs=rows),
        "output_rows+stored": lambda: results.stored("j", outputs=output_rows(output)),
    }
    usec = {name: round(1e6 * min(timeit.repeat(call, number=a.number, repeat=a.repeat))
                        / a.number, 1) for name, call in timed.items()}
    print(json.dumps({"rows": a.rows, "width": a.width, "usec_per_batch": usec,
                      "load_average": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
