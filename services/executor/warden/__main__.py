"""`python -m services.executor.warden FD`: serve the executor on the Unix socket FD."""

from __future__ import annotations

import socket
import sys

from services.executor.warden.server import Warden


def main() -> None:
    Warden(socket.socket(fileno=int(sys.argv[1]))).serve()


if __name__ == "__main__":
    main()
