"""No POSIX-only (or Windows-only) module or call outside training/os_compat.py, read from the source with ast.

Most ComfyUI users run Windows. Each rule here is a habit that once broke the pack there: `import resource` at load
(IMPORT FAILED, no node at all), fsync of a folder (a folder cannot be opened), `os.open` without O_BINARY (text
mode), `os.kill(pid, 0)` (Ctrl+C to ComfyUI's console), AF_UNIX, /proc, and text files opened without an encoding
(the Windows default is the ANSI code page, so a caption or JSON with "é" is read as something else)."""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
OS_MODULE = REPO / "training" / "os_compat.py"
# Everything a user's ComfyUI runs: the package, the nodes, the engine, and the scripts users start (headroom_run).
SCANNED = [REPO / "__init__.py", *sorted((REPO / "nodes").rglob("*.py")), *sorted((REPO / "training").rglob("*.py")),
           *sorted((REPO / "workflows").glob("*.py"))]

POSIX_ONLY_MODULES = {"resource", "fcntl", "termios", "pwd", "grp", "posix", "pty", "tty", "syslog", "crypt",
                      "msvcrt", "winreg", "_winapi"}
OS_ONLY_ATTRIBUTES = {
    "os": {"kill", "killpg", "open", "fsync", "fdatasync", "fork", "setsid", "getuid", "geteuid", "getgid", "getpgid",
           "sysconf", "statvfs", "getloadavg", "sched_getaffinity", "nice", "mkfifo", "chown", "O_NOFOLLOW",
           "O_DIRECTORY", "O_NONBLOCK", "O_BINARY", "WNOHANG", "uname", "posix_fadvise", "POSIX_FADV_DONTNEED"},
    "socket": {"AF_UNIX"},
    "signal": {"SIGKILL", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD", "alarm", "setitimer", "pause"},
}
POSIX_PATHS = ("/proc/", "/dev/shm", "/sys/")


def _text_open_without_encoding(node: ast.Call) -> bool:
    """open(...) / Path.read_text() / write_text() / NamedTemporaryFile(...) in text mode with no encoding given."""
    keywords = {keyword.arg for keyword in node.keywords}
    if "encoding" in keywords:
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in ("read_text", "write_text"):
        return True
    if isinstance(func, ast.Name) and func.id == "open" or (
            isinstance(func, ast.Attribute) and func.attr == "NamedTemporaryFile"):
        default = "r" if isinstance(func, ast.Name) else "w+b"
        mode = node.args[1] if isinstance(func, ast.Name) and len(node.args) > 1 else (
            node.args[0] if isinstance(func, ast.Attribute) and node.args else None)
        for keyword in node.keywords:
            if keyword.arg == "mode":
                mode = keyword.value
        text = mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else (
            default if mode is None else "b")  # a computed mode: not judged here
        return "b" not in text
    return False


def portability_problems(path: pathlib.Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    problems = []
    where = path.relative_to(REPO).as_posix()
    for node in ast.walk(ast.parse(source, str(path))):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            problems += [f"{line}: import {alias.name}" for alias in node.names
                         if alias.name.split(".")[0] in POSIX_ONLY_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in POSIX_ONLY_MODULES:
                problems.append(f"{line}: from {node.module} import ...")
            for alias in node.names:
                if alias.name in OS_ONLY_ATTRIBUTES.get(node.module, ()):
                    problems.append(f"{line}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.attr in OS_ONLY_ATTRIBUTES.get(node.value.id, ()):
                problems.append(f"{line}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(POSIX_PATHS):
                problems.append(f"{line}: the path {node.value!r}")
        elif isinstance(node, ast.Call) and _text_open_without_encoding(node):
            problems.append(f"{line}: a text file opened without encoding=")
    return problems


def test_posix_only_code_lives_in_os_compat():
    problems = [problem for path in SCANNED if path != OS_MODULE for problem in portability_problems(path)]
    assert not problems, ("POSIX-only (or Windows-only) code outside training/os_compat.py; call os_compat instead "
                          "(or add the difference there):\n" + "\n".join(problems))


def test_the_rules_catch_each_habit(tmp_path):
    """Each rule fires on the code that once broke Windows users (so the scan above cannot pass by matching nothing)."""
    cases = {
        "import resource": "import resource",
        "from fcntl import flock": "from fcntl import",
        "import os\nos.kill(1, 0)": "os.kill",
        "import os\nfd = os.open('x', os.O_RDONLY)": "os.open",
        "import os\nos.fsync(3)": "os.fsync",
        "import socket\nsocket.AF_UNIX": "socket.AF_UNIX",
        "open('/proc/self/status', encoding='ascii')": "/proc/",
        "open('caption.txt')": "without encoding",
        "open('x.json', 'w')": "without encoding",
        "import pathlib\npathlib.Path('x').read_text()": "without encoding",
        "import tempfile\ntempfile.NamedTemporaryFile('w')": "without encoding",
    }
    for number, (source, expected) in enumerate(cases.items()):
        path = REPO / "tests" / "unit" / f".portability_case_{number}.py"
        path.write_text(source, encoding="utf-8")
        try:
            problems = portability_problems(path)
        finally:
            path.unlink()
        assert any(expected in problem for problem in problems), (source, problems)
    fine = "open('x', 'rb')\nopen('y', 'w', encoding='utf-8')\nimport pathlib\npathlib.Path('z').read_bytes()"
    path = REPO / "tests" / "unit" / ".portability_case_fine.py"
    path.write_text(fine, encoding="utf-8")
    try:
        assert portability_problems(path) == []
    finally:
        path.unlink()
