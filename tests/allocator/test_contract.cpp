// gact/tests/allocator/test_contract.cpp — the allocator contract (contract.hpp)
// over the host backend and over the manual-event test backend, which is also called with the lock released.
#include "contract.hpp"
#include "fixtures.hpp"

TEST_CASE_TEMPLATE_INVOKE(allocator_contract, gact::test::host_fixture, gact::test::manual_fixture,
                          gact::test::unlocked_fixture);
