// kube-node: kubelet, kube-controller-manager, kube-scheduler and kube-proxy of k8s.io/kubernetes in one binary (one
// link instead of four, as hyperkube was), chosen by the first argument. Built by scripts/testenv for the bed's node.
package main

import (
	"context"
	"fmt"
	"os"
	_ "time/tzdata"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	commands := map[string]func() *cobra.Command{
		"kubelet":                 func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
		"kube-controller-manager": controllermanager.NewControllerManagerCommand,
		"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
		"kube-proxy":              proxy.NewProxyCommand,
	}
	if len(os.Args) < 2 || commands[os.Args[1]] == nil {
		fmt.Fprintln(os.Stderr, "usage: kube-node kubelet|kube-controller-manager|kube-scheduler|kube-proxy [flags]")
		os.Exit(2)
	}
	name := os.Args[1]
	os.Args = append([]string{name}, os.Args[2:]...)
	os.Exit(cli.Run(commands[name]()))
}
