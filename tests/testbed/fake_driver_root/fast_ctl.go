// The fake driver root's nvidia-imex-ctl: the two queries the service runs, answered without an interpreter.
//
// The node agent runs `nvidia-imex-ctl -q -u <socket>` (chrooted into the driver root) in every hostManaged
// Prepare, and the IMEX daemon wrapper runs `nvidia-imex-ctl -c <imexd.cfg> -q` for every readiness ask.
// The real ctl is a C program that costs a few milliseconds; the simulator's ctl is Python (20-50 ms a run
// on the test bed's cores). This program answers exactly those two forms against the simulator's command
// service (one line `{"cmd":"status"}`, one JSON object back, see tests/testbed/imex_simulator/wire.py) and
// prints what the simulator's ctl prints: the "state", or UNAVAILABLE and exit 1 with the reason on stderr.
// Any other command line is run by the simulator's ctl, `nvidia-imex-ctl.sim` beside this file
// (tests/testbed/imex_simulator/ctl.py), which the driver root carries; a container that mounts only this
// file (the daemon's) has the two forms above and nothing else.
//
// Where it differs from the simulator's ctl: `-c` reads only IMEX_CMD_BIND_INTERFACE_IP, IMEX_CMD_PORT and
// IMEX_CMD_UNIX_DOMAIN_PATH, the keys that name the command service; a config it cannot read that way goes
// to the simulator's ctl, whose errors name the field.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

const (
	unavailable = "UNAVAILABLE"
	timeout     = 5 * time.Second // the simulator's ctl's default -t
	maxLine     = 1 << 20         // wire.MAX_LINE
	defaultPort = 50005
	fallback    = "nvidia-imex-ctl.sim"
)

func main() {
	network, address, ok := fastTarget(os.Args[1:])
	if !ok {
		simulated(os.Args)
	}
	state, err := query(network, address)
	if err != nil {
		fmt.Println(unavailable)
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(state)
}

// fastTarget: the command service of `-q -u S`, `-q --u=S`, `-u S -q` or `-c CFG -q`; ok false for anything else.
func fastTarget(args []string) (network, address string, ok bool) {
	switch {
	case len(args) == 3 && args[0] == "-q" && args[1] == "-u":
		return "unix", args[2], true
	case len(args) == 3 && args[0] == "-u" && args[2] == "-q":
		return "unix", args[1], true
	case len(args) == 2 && args[0] == "-q" && strings.HasPrefix(args[1], "--u="):
		return "unix", strings.TrimPrefix(args[1], "--u="), true
	case len(args) == 3 && args[0] == "-c" && args[2] == "-q":
		return fromConfig(args[1])
	}
	return "", "", false
}

func fromConfig(path string) (network, address string, ok bool) {
	data, err := os.ReadFile(path)
	if err != nil || len(data) > maxLine {
		return "", "", false
	}
	values := map[string]string{}
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		key, value, found := strings.Cut(line, "=")
		if !found {
			return "", "", false
		}
		values[strings.TrimSpace(key)] = strings.TrimSpace(value)
	}
	port := defaultPort
	if text, set := values["IMEX_CMD_PORT"]; set {
		if port, err = strconv.Atoi(text); err != nil || port < 1 || port > 65535 {
			return "", "", false
		}
	}
	switch ip := values["IMEX_CMD_BIND_INTERFACE_IP"]; {
	case ip != "":
		if net.ParseIP(ip) == nil {
			return "", "", false
		}
		return "tcp", net.JoinHostPort(ip, strconv.Itoa(port)), true
	case values["IMEX_CMD_UNIX_DOMAIN_PATH"] != "":
		return "unix", values["IMEX_CMD_UNIX_DOMAIN_PATH"], true
	}
	return "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), true
}

func query(network, address string) (string, error) {
	deadline := time.Now().Add(timeout)
	conn, err := net.DialTimeout(network, address, timeout)
	if err != nil {
		return "", fmt.Errorf("cannot connect to the IMEX command service at %s: %v", address, err)
	}
	defer conn.Close()
	if err = conn.SetDeadline(deadline); err != nil {
		return "", err
	}
	if _, err = conn.Write([]byte("{\"cmd\":\"status\"}\n")); err != nil {
		return "", fmt.Errorf("IMEX command service at %s: %v", address, err)
	}
	reader := bufio.NewReaderSize(conn, 64*1024)
	var line []byte
	for {
		chunk, prefix, err := reader.ReadLine()
		if err != nil {
			if len(line) == 0 {
				return "", fmt.Errorf("IMEX command service at %s closed the connection", address)
			}
			return "", fmt.Errorf("IMEX command service at %s: %v", address, err)
		}
		line = append(line, chunk...)
		if len(line) > maxLine {
			return "", fmt.Errorf("an answer longer than %d bytes from %s", maxLine, address)
		}
		if !prefix {
			break
		}
	}
	var status map[string]any
	if err = json.Unmarshal(line, &status); err != nil {
		return "", fmt.Errorf("not a JSON object from %s", address)
	}
	if state, ok := status["state"].(string); ok {
		return state, nil
	}
	return unavailable, nil
}

// simulated runs the simulator's ctl beside this file with the same arguments (it does not return).
func simulated(argv []string) {
	self := argv[0]
	if !strings.Contains(self, "/") {
		if found, err := exec.LookPath(self); err == nil {
			self = found
		}
	}
	path := filepath.Join(filepath.Dir(self), fallback)
	err := syscall.Exec(path, append([]string{path}, argv[1:]...), os.Environ())
	fmt.Fprintf(os.Stderr, "nvidia-imex-ctl (simulated): %s answers only -q with -u or -c; %s: %v\n", self, path, err)
	os.Exit(2)
}
