"""File viewing and editing confined to the workspace, with undo of the last edit."""

from __future__ import annotations

import os

from prorl_farm.errors import ToolRejected

MAX_VIEW_BYTES = 256 * 1024


class FileEditor:
    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        self.history: dict[str, list[str | None]] = {}

    def path(self, path: str) -> str:
        """The real path of ``path`` (relative to the workspace or absolute); it must stay
        inside the workspace, symlinks included."""
        if not isinstance(path, str) or not path:
            raise ToolRejected("path must be a non-empty string")
        full = os.path.realpath(path if os.path.isabs(path) else os.path.join(self.root, path))
        if full != self.root and not full.startswith(self.root + os.sep):
            raise ToolRejected(f"{path}: outside the workspace")
        return full

    def _read(self, full: str) -> str:
        try:
            with open(full, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            raise ToolRejected(f"{self._rel(full)}: no such file") from None
        except IsADirectoryError:
            raise ToolRejected(f"{self._rel(full)}: is a directory") from None
        except UnicodeDecodeError:
            raise ToolRejected(f"{self._rel(full)}: not a UTF-8 text file") from None

    def _write(self, full: str, text: str | None, record: bool = True) -> None:
        if record:
            before = self._read(full) if os.path.exists(full) else None
            self.history.setdefault(full, []).append(before)
        if text is None:
            os.unlink(full)
            return
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(text)

    def _rel(self, full: str) -> str:
        return os.path.relpath(full, self.root)

    def view(self, path: str, start_line: int | None = None, end_line: int | None = None
             ) -> dict:
        full = self.path(path)
        if os.path.isdir(full):
            entries = []
            for dirpath, dirnames, filenames in os.walk(full):
                depth = os.path.relpath(dirpath, full).count(os.sep)
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                if depth >= 1:
                    dirnames[:] = []
                for name in sorted(dirnames) + sorted(filenames):
                    entries.append(os.path.relpath(os.path.join(dirpath, name), self.root))
            return {"path": self._rel(full), "type": "directory", "entries": entries[:2000]}
        lines = self._read(full).splitlines()
        start = 1 if start_line is None else int(start_line)
        end = len(lines) if end_line in (None, -1) else int(end_line)
        if start < 1 or (lines and start > len(lines)) or end < start - 1:
            raise ToolRejected(f"invalid line range [{start}, {end}] for {len(lines)} lines")
        body = "\n".join(f"{i:6}\t{lines[i - 1]}" for i in range(start, min(end, len(lines)) + 1))
        truncated = len(body) > MAX_VIEW_BYTES
        return {"path": self._rel(full), "type": "file", "lines": len(lines),
                "content": body[:MAX_VIEW_BYTES], "truncated": truncated}

    def create(self, path: str, content: str, overwrite: bool = False) -> dict:
        full = self.path(path)
        if os.path.isdir(full):
            raise ToolRejected(f"{self._rel(full)}: is a directory")
        if os.path.exists(full) and not overwrite:
            raise ToolRejected(f"{self._rel(full)}: exists (pass overwrite=true to replace it)")
        self._write(full, content)
        return {"path": self._rel(full), "bytes": len(content.encode())}

    def str_replace(self, path: str, old_str: str, new_str: str) -> dict:
        full = self.path(path)
        text = self._read(full)
        if not old_str:
            raise ToolRejected("old_str must not be empty")
        count = text.count(old_str)
        if count == 0:
            raise ToolRejected(f"old_str not found in {self._rel(full)}")
        if count > 1:
            lines, at = [], -1
            while (at := text.find(old_str, at + 1)) != -1:
                lines.append(text.count("\n", 0, at) + 1)
            raise ToolRejected(f"old_str occurs {count} times in {self._rel(full)} (lines "
                            f"{lines[:20]}); include more context to make it unique")
        new_text = text.replace(old_str, new_str, 1)
        self._write(full, new_text)
        line = text.count("\n", 0, text.find(old_str)) + 1
        return {"path": self._rel(full), "line": line}

    def insert(self, path: str, line: int, text: str) -> dict:
        full = self.path(path)
        lines = self._read(full).splitlines(keepends=True)
        if not isinstance(line, int) or line < 0 or line > len(lines):
            raise ToolRejected(f"line must be between 0 and {len(lines)}")
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        new = text if text.endswith("\n") else text + "\n"
        self._write(full, "".join(lines[:line]) + new + "".join(lines[line:]))
        return {"path": self._rel(full), "line": line}

    def undo(self, path: str) -> dict:
        full = self.path(path)
        stack = self.history.get(full)
        if not stack:
            raise ToolRejected(f"no edit of {self._rel(full)} to undo")
        self._write(full, stack.pop(), record=False)
        return {"path": self._rel(full), "restored": True}
