// gact/tests/cuda/test_cuda_contract.cpp — the allocator contract (tests/allocator/contract.hpp)
// over cuda_backend and pinned_host_backend, both on the fake runtime with asynchronous streams.
#include "tests/allocator/contract.hpp"
#include "cuda_fixtures.hpp"

TEST_CASE_TEMPLATE_INVOKE(allocator_contract, gact::test::cuda_fixture, gact::test::pinned_fixture);
