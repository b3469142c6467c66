"""A connection plugin for the simulated fleet: the local connection, a link that can go down,
and a counter of the bytes each board is sent and sends back.

A simulated board is a root tree on this machine, reached with Ansible's own
``local`` connection. This plugin is that connection with two things a real
link has: it goes down while ``$SIMBOARD_DIR/<board>.unreachable`` exists
(each task's connection is then refused as an SSH connection that cannot be
made is: ``AnsibleConnectionFailure``, so Ansible's own unreachable path runs;
a task already connected finishes, as a command already running does), and
it counts the bytes a board is sent (the module
Ansible pipes in, the command line, files put there) and sends back (its
output, files fetched), appending ``sent N`` and ``received N`` lines to
``$SIMBOARD_DIR/<board>.bytes``. Enabled with ``ANSIBLE_CONNECTION_PLUGINS``
and the host variable ``ansible_connection: simboard``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleConnectionFailure
from ansible.plugins.connection.local import Connection as LocalConnection

DOCUMENTATION = """
    name: simboard
    short_description: the local connection with a link that can go down (slmguard's tests)
    description: [Local execution; unreachable while SIMBOARD_DIR/BOARD.unreachable exists.]
    extends_documentation_fragment:
        - connection_pipelining
"""


class Connection(LocalConnection):  # type: ignore[misc]
    transport = "simboard"

    def _board(self) -> str:
        return str(self._play_context.remote_addr or "")

    def _files(self) -> Path:
        return Path(os.environ["SIMBOARD_DIR"])

    def _check_link(self) -> None:
        if (self._files() / f"{self._board()}.unreachable").exists():
            raise AnsibleConnectionFailure(
                f"ssh: connect to host {self._board()} port 22: No route to host"
            )

    def _count(self, sent: int, received: int) -> None:
        with (self._files() / f"{self._board()}.bytes").open("a") as f:
            f.write(f"sent {sent}\nreceived {received}\n")

    def _connect(self) -> Any:
        self._check_link()
        return super()._connect()

    def exec_command(self, cmd: str, in_data: bytes | None = None, sudoable: bool = True) -> Any:
        rc, out, err = super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        self._count(len(cmd.encode()) + len(in_data or b""), len(out) + len(err))
        return rc, out, err

    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)
        self._count(os.path.getsize(in_path), 0)

    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)
        self._count(0, os.path.getsize(out_path))
