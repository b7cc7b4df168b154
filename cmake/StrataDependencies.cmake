# Third-party libraries, all from Debian packages (scripts/install-deps.sh).
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(spdlog CONFIG REQUIRED)
find_package(fmt CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(GTest CONFIG REQUIRED)

# OpenBLAS: the OpenMP variant, so BLAS threads and our own OpenMP loops share one pool.
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
pkg_check_modules(SENTENCEPIECE REQUIRED IMPORTED_TARGET sentencepiece)

# transport: MPI (Open MPI; the C API, used from C++) and Cap'n Proto for control messages.
find_package(MPI REQUIRED COMPONENTS C CXX)
find_package(CapnProto CONFIG REQUIRED)

# transport: the Redis stream client (hiredis 0.14's synchronous API).
pkg_check_modules(HIREDIS REQUIRED IMPORTED_TARGET hiredis)

# launch: `serve --metrics-port` answers Prometheus over cpp-httplib (header + library).
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
