"""A one-line progress bar on stderr (stdout keeps only the results).

On a terminal the line is redrawn in place with the current step; in a log file only
finished steps are written, one per line.
"""

import sys
import time


class Progress:
    def __init__(self, total, width=30, stream=sys.stderr):
        self.total, self.width, self.stream = max(total, 1), width, stream
        self.done, self.start = 0, time.perf_counter()
        self.in_place = stream.isatty()

    def _line(self, label):
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        return f"[{bar}] {self.done}/{self.total} {time.perf_counter() - self.start:5.0f}s {label}"

    def show(self, label):
        if self.in_place:
            self.stream.write("\r" + self._line(label)[:150].ljust(150))
            self.stream.flush()

    def step(self, label=""):
        self.done += 1
        if self.in_place:
            self.show(label)
        else:
            self.stream.write(self._line(label) + "\n")
            self.stream.flush()

    def close(self):
        if self.in_place:
            self.stream.write("\n")
            self.stream.flush()
