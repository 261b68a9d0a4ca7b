// runc-wrapper runs runc after removing one capability from the OCI spec.
//
// The VMs this project runs on withhold CAP_SYS_RESOURCE from root, so runc cannot
// grant it to a container: a privileged container (or one that asks for that
// capability) fails with "unable to apply caps: operation not permitted". containerd
// and dockerd call this program in runc's place; before `create` or `run` it rewrites
// the bundle's config.json, and before `exec` the --process file, without the
// capabilities the calling process lacks, then execs the real runc with the same
// arguments. On a machine that has every capability it changes nothing.
//
// The real runc is $KUBESHARD_REAL_RUNC, else /usr/sbin/runc, else runc on PATH.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// capNames maps capability numbers (as in /proc/self/status CapEff) to OCI names.
var capNames = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
	"CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
	"CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
	"CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
	"CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
	"CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
	"CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
	"CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
	"CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
}

// missingCaps: the OCI names of the capabilities this process lacks in its bounding set.
func missingCaps() (map[string]bool, error) {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if !strings.HasPrefix(line, "CapBnd:") {
			continue
		}
		bnd, err := strconv.ParseUint(strings.TrimSpace(strings.TrimPrefix(line, "CapBnd:")), 16, 64)
		if err != nil {
			return nil, err
		}
		missing := map[string]bool{}
		for i, name := range capNames {
			if bnd&(1<<uint(i)) == 0 {
				missing[name] = true
			}
		}
		return missing, nil
	}
	return nil, fmt.Errorf("no CapBnd line in /proc/self/status")
}

// dropFrom removes the missing capabilities from every set of a capabilities object.
func dropFrom(caps map[string]any, missing map[string]bool) bool {
	changed := false
	for set, v := range caps {
		list, ok := v.([]any)
		if !ok {
			continue
		}
		kept := make([]any, 0, len(list))
		for _, c := range list {
			if s, ok := c.(string); ok && missing[s] {
				changed = true
				continue
			}
			kept = append(kept, c)
		}
		caps[set] = kept
	}
	return changed
}

// rewrite edits a JSON file in place; process is the path to the process object
// ("process" inside config.json, the top level of an exec --process file).
func rewrite(path string, inConfig bool, missing map[string]bool) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var doc map[string]any
	if err := json.Unmarshal(raw, &doc); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	proc := doc
	if inConfig {
		p, ok := doc["process"].(map[string]any)
		if !ok {
			return nil
		}
		proc = p
	}
	caps, ok := proc["capabilities"].(map[string]any)
	if !ok || !dropFrom(caps, missing) {
		return nil
	}
	out, err := json.Marshal(doc)
	if err != nil {
		return err
	}
	info, err := os.Stat(path)
	if err != nil {
		return err
	}
	tmp := path + ".runc-wrapper"
	if err := os.WriteFile(tmp, out, info.Mode().Perm()); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// flagValue finds --name VALUE, --name=VALUE or -short VALUE after the subcommand.
func flagValue(args []string, long, short string) string {
	for i, a := range args {
		switch {
		case (a == "--"+long || (short != "" && a == "-"+short)) && i+1 < len(args):
			return args[i+1]
		case strings.HasPrefix(a, "--"+long+"="):
			return strings.TrimPrefix(a, "--"+long+"=")
		}
	}
	return ""
}

// subcommand: the first argument that is not a global flag (global flags with values:
// --root, --log, --log-format, --criu; the rest are booleans).
func subcommand(args []string) (string, []string) {
	withValue := map[string]bool{"--root": true, "--log": true, "--log-format": true, "--criu": true}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			return a, args[i+1:]
		}
		if withValue[a] {
			i++
		}
	}
	return "", nil
}

func realRunc() string {
	if p := os.Getenv("KUBESHARD_REAL_RUNC"); p != "" {
		return p
	}
	self, _ := os.Executable()
	for _, p := range []string{"/usr/sbin/runc", "/usr/bin/runc"} {
		if resolved, err := filepath.EvalSymlinks(p); err == nil && resolved != self {
			return p
		}
	}
	p, err := exec.LookPath("runc")
	if err != nil {
		fmt.Fprintln(os.Stderr, "runc-wrapper: the real runc is not installed")
		os.Exit(127)
	}
	return p
}

func main() {
	args := os.Args[1:]
	cmd, rest := subcommand(args)
	if cmd == "create" || cmd == "run" || cmd == "exec" {
		missing, err := missingCaps()
		if err != nil {
			fmt.Fprintln(os.Stderr, "runc-wrapper:", err)
			os.Exit(1)
		}
		if len(missing) > 0 {
			var target string
			inConfig := true
			if cmd == "exec" {
				target, inConfig = flagValue(rest, "process", "p"), false
			} else {
				bundle := flagValue(rest, "bundle", "b")
				if bundle == "" {
					bundle = "."
				}
				target = filepath.Join(bundle, "config.json")
			}
			if target != "" {
				if err := rewrite(target, inConfig, missing); err != nil {
					fmt.Fprintln(os.Stderr, "runc-wrapper:", err)
					os.Exit(1)
				}
			}
		}
	}
	runc := realRunc()
	if err := syscall.Exec(runc, append([]string{runc}, args...), os.Environ()); err != nil {
		fmt.Fprintln(os.Stderr, "runc-wrapper: exec", runc+":", err)
		os.Exit(127)
	}
}
