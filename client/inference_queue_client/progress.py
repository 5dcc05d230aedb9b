"""What `iq-client` shows while it waits: on a terminal, one line redrawn in place on stderr
(jobs finished, and the items done of the job being waited for, from its event stream);
piped or redirected, nothing, so that the output stays one JSON object a line."""
from __future__ import annotations

import shutil
from typing import IO

from inference_queue_client.jobs import Job

WIDTH = 24  # cells of the bar itself


class Bar:
    """`[#######.................]  3/8 jobs  41%  8f692a53: 96/256 items` on one line."""

    def __init__(self, stream: IO[str], jobs: int) -> None:
        self.stream, self.jobs, self.finished = stream, max(jobs, 1), 0
        self.current: Job | None = None
        self.shown = False

    def update(self, job: Job) -> None:
        """The job being waited for, as it now stands; once final, it counts as finished."""
        if job.terminal:
            self.finished += 1
            self.current = None
        else:
            self.current = job
        self.draw()

    def line(self) -> str:
        fraction, detail = float(self.finished), ""
        if self.current is not None:
            progress = self.current.progress or {}
            done, items = progress.get("items_done", 0), max(progress.get("items", 1), 1)
            fraction += done / items
            detail = f"  {self.current.id[:8]}: {self.current.status}, {done}/{items} items"
        share = min(fraction / self.jobs, 1.0)
        cells = int(share * WIDTH)
        return (f"[{'#' * cells}{'.' * (WIDTH - cells)}] {self.finished}/{self.jobs} jobs "
                f"{share:4.0%}{detail}")

    def draw(self) -> None:
        columns = shutil.get_terminal_size((80, 24)).columns
        self.stream.write("\r" + self.line()[:columns - 1] + "\x1b[K")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        """Off the screen (before a line of output, and at the end)."""
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False
