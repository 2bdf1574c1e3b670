"""How much a directory holds on disk: the tool server bounds a workspace with it
(toolserver/quota.py), and a grader's jail its scratch space. The standard library alone:
a grader ships with this text included (graders/jail.py: ``# include:
../toolserver/disk.py``)."""

import os


def disk_usage(root: str) -> int:
    """Bytes on disk under ``root`` (``st_blocks``; hard links once), without following
    links or entering another file system."""
    try:
        dev = os.lstat(root).st_dev
    except OSError:
        return 0
    total, seen, todo = 0, set(), [root]
    while todo:
        try:
            entries = os.scandir(todo.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev != dev:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
                if st.st_nlink > 1:
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total
