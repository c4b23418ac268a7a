#!/usr/bin/env bash
# Generates rtrl/v1/*_pb2*.py from proto/. Reproducible: pinned grpcio-tools, sorted inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f rtrl/v1/*_pb2.py rtrl/v1/*_pb2.pyi rtrl/v1/*_pb2_grpc.py
python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(ls proto/rtrl/v1/*.proto | sort)
touch rtrl/v1/__init__.py
