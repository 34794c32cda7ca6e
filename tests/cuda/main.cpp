// gact/tests/cuda/main.cpp — doctest main of test_cuda (the host-side CUDA code over the fake runtime).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
