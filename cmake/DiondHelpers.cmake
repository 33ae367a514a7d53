# Helpers that declare every library and test of the project (STYLE.md B2).
#
# diond_cc_library(NAME <name> [HDRS ...] SRCS ... [DEPS ...] [PRIVATE_DEPS ...])
#   Creates the static library diond_<name> and the alias diond::<name>. DEPS are PUBLIC links:
#   the dependency rule of ARCHITECTURE.md §3 is encoded by which diond:: targets a layer may
#   name here, so a forbidden include does not find its header and does not build.
# diond_cc_test(NAME <name> SRCS ... [DEPS ...] [LABELS ...] [TIMEOUT s])
#   Creates the GoogleTest binary <name> and registers its cases with ctest.

set(DIOND_WARNINGS -Wall -Wextra -Werror=unused-result -Wno-unused-parameter)
if(DIOND_WERROR)
  list(APPEND DIOND_WARNINGS -Werror)
endif()

function(diond_apply_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${DIOND_WARNINGS}>)
endfunction()

function(diond_cc_library)
  cmake_parse_arguments(A "" "NAME" "HDRS;SRCS;DEPS;PRIVATE_DEPS" ${ARGN})
  set(t diond_${A_NAME})
  if(A_SRCS)
    add_library(${t} STATIC ${A_SRCS} ${A_HDRS})
    target_include_directories(${t} PUBLIC
      $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<INSTALL_INTERFACE:include>)
    target_link_libraries(${t} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
    diond_apply_warnings(${t})
  else()
    add_library(${t} INTERFACE ${A_HDRS})
    target_include_directories(${t} INTERFACE
      $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<INSTALL_INTERFACE:include>)
    target_link_libraries(${t} INTERFACE ${A_DEPS})
  endif()
  set_target_properties(${t} PROPERTIES EXPORT_NAME ${A_NAME})
  add_library(diond::${A_NAME} ALIAS ${t})
endfunction()

function(diond_cc_test)
  if(NOT DIOND_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(A "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS;ENV" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gmock GTest::gtest_main)
  diond_apply_warnings(${A_NAME})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  set(props TIMEOUT ${A_TIMEOUT})
  if(A_LABELS)
    list(APPEND props LABELS "${A_LABELS}")
  endif()
  if(A_ENV)
    list(APPEND props ENVIRONMENT "${A_ENV}")
  endif()
  gtest_discover_tests(${A_NAME} DISCOVERY_TIMEOUT 60 PROPERTIES ${props})
endfunction()
