#!/usr/bin/env bash
# build.sh OUT [VERSION] — the release build of capper, the one the Dockerfile and `make build` run:
#   static       CGO_ENABLED=0 (no libc: runs on distroless/static or scratch)
#   reproducible -trimpath and an empty build id: the same source and toolchain give the same bytes
#   stamped      VERSION (default: VERSION from the environment, then `git describe`, then "dev") and the
#                commit (REVISION, default `git rev-parse HEAD`) are what `capper version` prints and
#                capper_build_info{version,revision} exports
#   self-contained time zones (-tags timetzdata): rules in users' zones work on an image without tzdata
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: build.sh OUT [VERSION]}
version=${2:-${VERSION:-$(git -C "$ROOT" describe --tags --always --dirty 2>/dev/null || echo dev)}}
revision=${REVISION:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}
pkg=github.com/capper-dev/capper/internal/version
cd "$ROOT"
CGO_ENABLED=0 go build -trimpath -tags timetzdata \
  -ldflags "-s -w -buildid= -X $pkg.Version=$version -X $pkg.Revision=$revision" \
  -o "$out" ./cmd/capper
