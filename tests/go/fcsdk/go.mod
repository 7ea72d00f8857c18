module ferrovm/tests/fcsdk

go 1.19

require github.com/firecracker-microvm/firecracker-go-sdk v1.0.0
