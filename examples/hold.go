// hold: holds N MiB in 1 MiB []byte buffers, every 64th byte written with its own
// value, then reads them all back twice and says "go: ok" if every byte is right
// (else "bad BUFFER OFFSET got VALUE" and exit status 1). For `uzswap bench programs`
// and the CLI's run_go test; build it with cgo and external linking, as a static Go
// binary never loads the shim: CGO_ENABLED=1 go build -ldflags=-linkmode=external.
package main

import (
	"fmt"
	"os"
	"strconv"
)

func main() {
	mib, _ := strconv.Atoi(os.Args[1])
	bufs := make([][]byte, mib)
	for i := range bufs {
		b := make([]byte, 1<<20)
		for j := 0; j < len(b); j += 64 {
			b[j] = byte(i + j/64)
		}
		bufs[i] = b
	}
	for pass := 0; pass < 2; pass++ {
		for i, b := range bufs {
			for j := 0; j < len(b); j += 64 {
				if b[j] != byte(i+j/64) {
					fmt.Println("bad", i, j, "got", b[j])
					os.Exit(1)
				}
			}
		}
	}
	fmt.Println("go: ok")
}
