//go:build tools

// Package tools records, for `go mod tidy`, the main packages hack/kind-node.sh builds
// from this module; it is never compiled.
package tools

import (
	_ "sigs.k8s.io/kind"
)
