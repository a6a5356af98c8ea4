"""Run ``ascend-emu`` as its own process (``python -m ascend_emu.cli``), optionally with stderr on a terminal (a pty)
so that rich draws its progress bar, and Ctrl-C it once a pattern shows. Every wait is bounded."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

COMMAND = [sys.executable, "-m", "ascend_emu.cli"]
TIMEOUT_S = 600          # a bound against hangs, not a performance assertion


def run(args, timeout: float = TIMEOUT_S, **kw) -> subprocess.CompletedProcess:
    """Run to completion, stdout and stderr captured."""
    return subprocess.run(COMMAND + list(args), capture_output=True, text=True, timeout=timeout, **kw)


def _default_sigint():
    """In the child: Ctrl-C as at a shell prompt (a test runner started in the background may ignore SIGINT, and an
    ignored SIGINT is inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_on_terminal(args, pattern: str, *, interrupt: bool = False, timeout: float = TIMEOUT_S):
    """Run with stderr on a pty until ``pattern`` shows on it (then send SIGINT if ``interrupt``), or to the end.
    Returns (exit code, stdout, stderr text as the terminal got it, whether the pattern showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(COMMAND + list(args), stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True, preexec_fn=_default_sigint)
    os.close(slave)
    seen, err = False, b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:          # the child closed its end
                    break
                err += chunk
                if not seen and re.search(pattern.encode(), err):
                    seen = True
                    if interrupt:
                        proc.send_signal(signal.SIGINT)
            elif proc.poll() is not None:
                break
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            err += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return proc.returncode, out, err.decode(errors="replace"), seen
