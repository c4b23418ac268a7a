#!/usr/bin/env bash
# Generates the Python protobuf code from proto/. Reproducible: pinned grpcio-tools, sorted
# inputs. What product clients send (telemetry.proto, ingest.proto) goes to the client
# distribution, clients/python/src/rtrl_client/v1, with its imports renamed to that package
# (protoc names a module after its .proto path, rtrl.v1); the rest goes to rtrl/v1.
# The descriptor pool still knows the files as rtrl/v1/*.proto, so the wire and the
# TypeScript client's generated code (clients/typescript) are unchanged by the move.
set -euo pipefail
cd "$(dirname "$0")/.."
client_dir=clients/python/src/rtrl_client/v1
client_protos="ingest telemetry"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" $(ls proto/rtrl/v1/*.proto | sort)

rm -f rtrl/v1/*_pb2.py rtrl/v1/*_pb2.pyi rtrl/v1/*_pb2_grpc.py "$client_dir"/*_pb2.py "$client_dir"/*_pb2.pyi "$client_dir"/*_pb2_grpc.py
mkdir -p "$client_dir"
rename='s/^from rtrl\.v1 import \(ingest\|telemetry\)_pb2 as /from rtrl_client.v1 import \1_pb2 as /'
for f in "$out"/rtrl/v1/*; do
  name=$(basename "$f")
  case " $client_protos " in
    *" ${name%%_pb2*} "*) dest=$client_dir ;;
    *) dest=rtrl/v1 ;;
  esac
  sed "$rename" "$f" > "$dest/$name"
done
touch rtrl/v1/__init__.py "$client_dir/__init__.py"
