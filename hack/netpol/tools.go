//go:build tools

// Package tools records, for `go mod tidy`, the main package hack/node-tools.sh builds
// from this module; it is never compiled.
package tools

import (
	_ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
)
