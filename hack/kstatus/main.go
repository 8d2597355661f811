// kstatus computes the status that Flux, kpt and cli-utils derive for a live object.
// Usage: kubectl get cgp NAME -o json | kstatus   ->   prints "<Status>\t<message>".
package main

import (
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	raw, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(err)
	}
	// Unstructured's own decoder keeps integers as int64, as the API machinery expects.
	object := &unstructured.Unstructured{}
	if err := object.UnmarshalJSON(raw); err != nil {
		fail(err)
	}
	result, err := status.Compute(object)
	if err != nil {
		fail(err)
	}
	fmt.Printf("%s\t%s\n", result.Status, result.Message)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}
