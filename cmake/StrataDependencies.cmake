# Third-party libraries, all from Debian packages (scripts/install-deps.sh).
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
if(STRATA_TSAN)
  # ThreadSanitizer cannot see libgomp's barriers, so every parallel region would read as a
  # race. Under it the regions compile serial (no -fopenmp; libgomp still links for the
  # omp_* calls), and what it checks is the project's own threads: the queue's I/O, the
  # layer store's reads, the compute thread, the metrics server, MPI's progress.
  # A variable that only a pragma's clause reads is then unused, by design.
  set_property(
    TARGET OpenMP::OpenMP_CXX
    PROPERTY INTERFACE_COMPILE_OPTIONS
             $<$<COMPILE_LANGUAGE:CXX>:-Wno-unknown-pragmas -Wno-unused-variable
             -Wno-unused-but-set-variable>)
endif()
find_package(spdlog CONFIG REQUIRED)
find_package(fmt CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(GTest CONFIG REQUIRED)

# OpenBLAS: the OpenMP variant, so BLAS threads and our own OpenMP loops share one pool.
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
pkg_check_modules(SENTENCEPIECE REQUIRED IMPORTED_TARGET sentencepiece)
# worker/text: tokenizer.json's pre-tokenizer regexes (PCRE2, JIT) and Unicode normalisation.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)

# transport: MPI (Open MPI; the C API, used from C++) and Cap'n Proto for control messages.
find_package(MPI REQUIRED COMPONENTS C CXX)
find_package(CapnProto CONFIG REQUIRED)

# transport: the Redis stream client (hiredis 0.14's synchronous API).
pkg_check_modules(HIREDIS REQUIRED IMPORTED_TARGET hiredis)

