"""The policy a worker group runs: the file as its supervisor read it, one read per reload.

Every worker of a group must apply the same policy at each reload. If each read the file
itself, a file replaced while the group reloads (a deploy writing it twice, an operator's
second ``mv``) would split the group: one worker serving the first file, another rejecting the
second. So only the supervisor reads the file: once per SIGHUP, it checks the text as
``llm-gateway check`` does, and writes what it decided to ``policy.json`` in the group's run
directory (written aside, then renamed: a reader sees the old record or the new one, whole)
before it signals any worker. A worker's reload applies that record and never opens the file:

- ``generation`` counts the reloads the group accepted (0: the policy it started with). A
  worker remembers the generation it runs (a worker forked later, the supervisor's at the
  fork) and builds ``text`` only when the record's differs;
- ``text``: the file as the group last accepted it; parsed under the file's own name, so
  problems still read ``file:line: key: message``;
- ``issues``: the last reload's problems (empty: accepted). A worker reports them as its own
  rejection and keeps running the accepted policy, as its siblings do.

A worker whose own build of an accepted text fails (a resource its siblings could open) keeps
its older policy and says so; the text itself is never what differs between workers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from policies.loader import PolicyError, PolicyIssue

RECORD = "policy.json"


@dataclass(frozen=True)
class GroupPolicy:
    generation: int = 0
    text: str | None = None  # None: no reload accepted yet (the group's start policy)
    issues: tuple[PolicyIssue, ...] = ()

    def accepted(self, text: str) -> GroupPolicy:
        return GroupPolicy(self.generation + 1, text)

    def rejected(self, exc: PolicyError) -> GroupPolicy:
        return GroupPolicy(self.generation, self.text, tuple(exc.issues))

    def rejection(self) -> PolicyError | None:
        return PolicyError(list(self.issues)) if self.issues else None

    def write(self, run_dir: Path) -> None:
        issues = [
            {"file": i.file, "line": i.line, "path": list(i.path), "message": i.message}
            for i in self.issues
        ]
        record = {"generation": self.generation, "text": self.text, "issues": issues}
        aside = run_dir / (RECORD + ".new")
        aside.write_text(json.dumps(record), encoding="utf-8")
        os.replace(aside, run_dir / RECORD)

    @classmethod
    def read(cls, run_dir: Path) -> GroupPolicy:
        """The supervisor's last record; none yet: the group still runs its start policy."""
        try:
            record = json.loads((run_dir / RECORD).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls()
        issues = tuple(
            PolicyIssue(i["file"], i["line"], tuple(i["path"]), i["message"])
            for i in record["issues"]
        )
        return cls(record["generation"], record["text"], issues)
