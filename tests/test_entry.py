"""The entry point that ends a stage's process early (core/entry.py) still does what a shutdown must."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, concurrent.futures, sys, threading, time
    import click
    from gpt2.core.entry import run
    POOLS = []

    @click.command()
    @click.argument("code", type=int)
    @click.argument("out")
    def command(code, out):
        def late():
            time.sleep(0.3)
            with open(out, "a") as f:
                f.write("thread ")
        threading.Thread(target=late).start()
        pool = concurrent.futures.ThreadPoolExecutor(2)  # idle workers wait for work until the pool is shut down
        pool.submit(print, end="")
        POOLS.append(pool)  # held for the process's life, as Inductor holds its compile pool
        atexit.register(lambda: open(out, "a").write("atexit"))
        sys.stdout.write("no newline, still flushed")
        if code:
            raise click.exceptions.Exit(code)

    run(command, prog_name="demo")
""")


def test_threads_exit_handlers_and_output_survive_the_early_exit(tmp_path):
    """A thread pool left open (a compiled model's) does not keep the process waiting: it hung in the join."""
    out = tmp_path / "out.txt"
    done = subprocess.run([sys.executable, "-c", SCRIPT, "3", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stdout == "no newline, still flushed"
    assert out.read_text() == "thread atexit"  # the thread joined first, then the exit handlers, as Python does


def test_a_usage_error_exits_as_click_says(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, "x", str(tmp_path / "o")], capture_output=True, text=True)
    assert done.returncode == 2 and "Invalid value for 'CODE'" in done.stderr
