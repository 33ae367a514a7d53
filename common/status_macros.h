// Status propagation macros.
//
// Debian 12's Abseil (20220623) has no ABSL_RETURN_IF_ERROR / ABSL_ASSIGN_OR_RETURN, so these
// macros give the same semantics under a diond prefix; a later switch to Abseil's own macros is
// a rename (STYLE.md E4). Thread-safe: they are pure expressions.
#ifndef DIOND_COMMON_STATUS_MACROS_H_
#define DIOND_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if not OK.
#define DIOND_RETURN_IF_ERROR(expr)                                    \
  do {                                                                 \
    ::absl::Status _diond_status = (expr);                             \
    if (ABSL_PREDICT_FALSE(!_diond_status.ok())) return _diond_status; \
  } while (false)

#define DIOND_STATUS_MACROS_CONCAT_INNER_(x, y) x##y
#define DIOND_STATUS_MACROS_CONCAT_(x, y) DIOND_STATUS_MACROS_CONCAT_INNER_(x, y)

// Evaluates `expr` (an absl::StatusOr<T>); on error returns its status, else moves the value into
// `lhs`, which may be a declaration (`auto x`) or an existing lvalue.
// NOLINTBEGIN(bugprone-macro-parentheses): `lhs` may be a declaration, which parentheses break.
#define DIOND_ASSIGN_OR_RETURN(lhs, expr) \
  DIOND_ASSIGN_OR_RETURN_IMPL_(DIOND_STATUS_MACROS_CONCAT_(_diond_statusor, __LINE__), lhs, expr)

#define DIOND_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)           \
  auto statusor = (expr);                                           \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) return statusor.status(); \
  lhs = std::move(statusor).value()
// NOLINTEND(bugprone-macro-parentheses)

#endif  // DIOND_COMMON_STATUS_MACROS_H_
