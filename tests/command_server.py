"""Runs `python -m hilt ARGS` for the tests without paying for Python and torch's start-up each time.

Started once per test process (tests/helpers.py: run_hilt), it imports torch and hilt's command line,
then for each request forks a child that is what `python -m hilt` would be: its own process, its own
working folder, environment, stdin from /dev/null, stdout and stderr to files, the exit status of the
command. Importing torch starts no thread, so forking is safe. A request is one JSON line on stdin
({"args", "cwd", "env", "stdout", "stderr"}); the answer is {"pid"} at once, then {"rc"}.
"""

import atexit
import json
import os
import runpy
import sys
import traceback

import torch  # noqa: F401  (the start-up the children share)

import hilt.cli  # noqa: F401


def _child(request: dict) -> int:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = ["hilt", *request["args"]]
    try:
        runpy.run_module("hilt", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed to stderr, status 1
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


def main() -> None:
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w")
    for line in requests:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            code = 1
            try:
                code = _child(json.loads(line))
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
