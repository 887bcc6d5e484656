#!/usr/bin/env bash
# Installs the Gateway API Inference Extension's reference endpoint picker
# (`cmd/epp`), pinned, from the Go module proxy, into the kvpick peers cache:
#
#   e2e/peers/install-gie-epp.sh        # -> ${XDG_CACHE_HOME:-$HOME/.cache}/kvpick-peers/bin/gie-epp
#
# Bench-only (like anchors/): nothing in `.ci/run` needs it. `kvpick-bench
# overhead --peer-epp` and the `peer_epp` test use the binary when it is there.
#
# `go install MODULE/cmd/epp@VERSION` cannot be used as is: the registry serves
# the pinned version but refuses the module's version list, which `go install
# pkg@version` reads for deprecation notices. So the package is built from a
# throwaway module in a temporary directory that requires the pinned version
# (the same module graph `go install` would use); nothing is kept but the binary.
#
# The llm-d Router (github.com/llm-d/llm-d-router, whose v0.10.0 builds on this
# module's v1.5.0 and keeps its default scheduling profile) is refused by the
# registry for every version, so it cannot be installed here; see
# e2e/peers/README.md.
set -euo pipefail

MODULE=sigs.k8s.io/gateway-api-inference-extension
VERSION=v1.5.0
BIN_DIR=${KVPICK_PEERS_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpick-peers/bin}

command -v go >/dev/null || { echo "install-gie-epp: needs Go (1.25 or newer)" >&2; exit 1; }
mkdir -p "$BIN_DIR"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
go mod init kvpick.local/peers >/dev/null 2>&1
cat > tools.go <<GO
//go:build tools

package tools

import _ "$MODULE/cmd/epp"
GO
go get "$MODULE@$VERSION"
nice -n 10 go mod tidy
GOBIN="$work/bin" nice -n 10 go install -trimpath "$MODULE/cmd/epp"
install -m 0755 "$work/bin/epp" "$BIN_DIR/gie-epp"
echo "$MODULE/cmd/epp@$VERSION" > "$BIN_DIR/gie-epp.version"
echo "installed $BIN_DIR/gie-epp ($MODULE/cmd/epp@$VERSION)"
