// gact/bindings/python/torch_graph.cpp
//
// `_gact_torch.graph_reaches`: the walk over autograd's graph that tells whether a saved tensor's
// call was given an operand computed from it (gact/saved.py: correlated, _reaches), in C++.
//
// The walk runs for every stored save whose call has another operand with a graph. Written in
// Python it reads `next_functions` node by node (a tuple of tuples made per node) and takes about
// 100 µs when it finds nothing within its bounds, as on an LSTM cell's hidden state, whose
// cell-state operand never leads back to it: that was a third of what gact added to the
// time step of a float64 LSTMCell model. Here it reads each node's edges in place.
//
// The semantics are saved.py's `_reaches`, node for node (tests/python/test_graph_walk.py
// compares both on random graphs): a breadth-first walk from each operand's grad_fn, `depth`
// levels at most and `max_nodes` distinct (barrier, node) pairs in all, over the nodes' next
// edges; an edge hits when it leads to a target tensor's (grad_fn, output_nr), or to the
// AccumulateGrad node of the leaf `leaf`. An operand whose `reduced` entry is set does not pass
// a node named in the square sums; no walk passes the view nodes from `chain_base`'s grad_fn back
// towards `chain_root`'s (the chain saved.py builds: 8 nodes at most). Both lists of names are
// saved.py's, given once (graph_configure).
//
// Tensors come as TensorImpl addresses (`Tensor._cdata`), which the caller holds alive for the
// call; grad_fn and output_nr are read through ATen's own accessors (the same that Python's
// `Tensor.grad_fn` uses, which rebuild a view's node after an in-place change).
#include <ATen/core/TensorBase.h>
#include <c10/core/SymInt.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/graph_task.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <utility>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace gact::bindings {
namespace {

using torch::autograd::Node;

/// The tensor at TensorImpl address `impl` (a new reference to it; the caller's Python tensor keeps it alive).
at::TensorBase tensor_at(std::uintptr_t impl) {
  if (impl == 0) throw py::value_error("graph_reaches: a null TensorImpl address");
  return at::TensorBase(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(reinterpret_cast<c10::TensorImpl*>(impl)));
}

/// Whether `node` is the AccumulateGrad node of the tensor at `leaf`.
bool accumulates(Node* node, c10::TensorImpl const* leaf) {
  auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node);
  return acc != nullptr && acc->variable.defined() && acc->variable.unsafeGetTensorImpl() == leaf;
}

/// graph_configure's names (set once, when gact/saved.py is imported, before any walk).
std::set<std::string> g_view_names;
std::set<std::string> g_square_sums;

void graph_configure(std::set<std::string> view_names, std::set<std::string> square_sums) {
  g_view_names = std::move(view_names);
  g_square_sums = std::move(square_sums);
}

bool graph_reaches(std::vector<std::uintptr_t> const& operands, std::vector<std::uintptr_t> const& targets,
                   std::uintptr_t leaf, std::vector<bool> const& reduced, std::uintptr_t chain_base,
                   std::uintptr_t chain_root, int depth, int max_nodes) {
  std::set<std::string> const& view_names = g_view_names;
  std::set<std::string> const& square_sums = g_square_sums;
  if (!reduced.empty() && reduced.size() != operands.size())
    throw py::value_error("graph_reaches: reduced must have one entry per operand");
  std::vector<std::pair<Node*, std::uint32_t>> hits;
  std::vector<std::shared_ptr<Node>> held;  // (the nodes compared by address stay alive through the walk)
  for (std::uintptr_t t : targets) {
    at::TensorBase const x = tensor_at(t);
    std::shared_ptr<Node> const& g = x.grad_fn();
    if (g) {
      hits.emplace_back(g.get(), static_cast<std::uint32_t>(x.output_nr()));
      held.push_back(g);
    }
  }
  c10::TensorImpl const* const leaf_impl = leaf != 0 ? reinterpret_cast<c10::TensorImpl const*>(leaf) : nullptr;
  // the view nodes between chain_base and chain_root, which no walk passes (saved.py: the `chain` of correlated)
  std::set<Node*> stop;
  if (chain_base != 0 && chain_root != 0) {
    at::TensorBase const root = tensor_at(chain_root);
    std::shared_ptr<Node> const root_fn = root.grad_fn();
    std::shared_ptr<Node> g = tensor_at(chain_base).grad_fn();
    for (int k = 0; k < 8; ++k) {
      if (!g || g == root_fn || view_names.count(g->name()) == 0) break;
      stop.insert(g.get());
      held.push_back(g);
      auto const& next = g->next_edges();
      g = next.empty() ? nullptr : next.front().function;
    }
  }
  auto const hit = [&](Node* fn, std::uint32_t nr) {
    for (auto const& [g, n] : hits) {
      if (g == fn && n == nr) return true;
    }
    return leaf_impl != nullptr && accumulates(fn, leaf_impl);
  };
  std::set<std::pair<bool, Node*>> seen;
  std::vector<std::shared_ptr<Node>> frontier;
  std::vector<std::shared_ptr<Node>> next;
  for (std::size_t j = 0; j < operands.size(); ++j) {
    bool const barrier = !reduced.empty() && reduced[j];
    frontier.clear();
    frontier.push_back(tensor_at(operands[j]).grad_fn());
    for (int level = 0; level < depth; ++level) {
      next.clear();
      for (std::shared_ptr<Node> const& node : frontier) {
        if (!node) continue;  // (an operand without a graph: nothing to walk)
        if ((barrier && square_sums.count(node->name()) != 0) || stop.count(node.get()) != 0) continue;
        for (torch::autograd::Edge const& e : node->next_edges()) {
          Node* const fn = e.function.get();
          if (fn == nullptr) continue;
          if (hit(fn, e.input_nr)) return true;
          if (seen.emplace(barrier, fn).second) next.push_back(e.function);
        }
        if (seen.size() > static_cast<std::size_t>(max_nodes)) return false;
      }
      if (next.empty()) break;
      frontier.swap(next);
    }
  }
  return false;
}

/// The address of the autograd node of the tensor at `impl` (its grad_fn), 0 without one: a node's identity while it
/// lives, where Python's wrapper objects are made again on each read of `grad_fn`.
std::uintptr_t graph_node(std::uintptr_t impl) {
  return reinterpret_cast<std::uintptr_t>(tensor_at(impl).grad_fn().get());
}

/// graph_configure_ancestors's names: the elementwise nodes (gact/saved.py ELEMENTWISE_NODES).
std::set<std::string> g_elementwise;

std::int64_t g_min_span = 0;

/// graph_configure_ancestors's matrix products (gact/saved.py PRODUCT_NODES): what a walk with `products` ends at.
std::set<std::string> g_products;

void graph_configure_ancestors(std::set<std::string> elementwise, std::int64_t min_span,
                               std::set<std::string> products) {
  g_elementwise = std::move(elementwise);
  g_min_span = min_span;
  g_products = std::move(products);
}

/// How many values the sum or mean `node` adds per element of its result: the product of its input's sizes over the
/// dimensions it reduces (all of them without any); -1 where not known (a symbolic size, a full mean, another node).
std::int64_t reduction_span(Node& node) {
  namespace gen = torch::autograd::generated;
  std::vector<c10::SymInt> const* sizes = nullptr;
  std::vector<std::int64_t> const* dims = nullptr;  // (none: all of them)
  if (auto* s1 = dynamic_cast<gen::SumBackward1*>(&node)) {
    sizes = &s1->self_sym_sizes;
    if (s1->dim.list) dims = &*s1->dim.list;
  } else if (auto* m1 = dynamic_cast<gen::MeanBackward1*>(&node)) {
    sizes = &m1->self_sym_sizes;
    if (m1->dim.list) dims = &*m1->dim.list;
  } else if (auto* s0 = dynamic_cast<gen::SumBackward0*>(&node)) {
    sizes = &s0->self_sym_sizes;
  } else {
    return -1;
  }
  auto const rank = static_cast<std::int64_t>(sizes->size());
  auto size_at = [&](std::int64_t d) -> std::int64_t {
    if (rank == 0) return 1;
    d = d < 0 ? d + rank : d;
    if (d < 0 || d >= rank) return -1;
    c10::SymInt const& s = (*sizes)[static_cast<std::size_t>(d)];
    return s.is_symbolic() ? -1 : s.as_int_unchecked();
  };
  bool const all = dims == nullptr || dims->empty();
  std::int64_t const count = all ? rank : static_cast<std::int64_t>(dims->size());
  std::int64_t span = 1;
  for (std::int64_t i = 0; i < count; ++i) {
    std::int64_t const n = size_at(all ? i : (*dims)[static_cast<std::size_t>(i)]);
    if (n < 0) return -1;
    span *= n;
  }
  return span;
}

/// Whether the sum or mean `reduction` adds at least g_min_span values per element of its result (unknown: yes).
bool spans_many(Node& reduction) {
  std::int64_t const span = reduction_span(reduction);
  return span < 0 || span >= g_min_span;
}

/// Whether `name` is a sum or a mean (SumBackward0, MeanBackward1, ...).
bool is_reduction(std::string const& name) {
  return name.rfind("SumBackward", 0) == 0 || name.rfind("MeanBackward", 0) == 0;
}

/// Whether the node `fn`, named `name`, squares what it reads: one of graph_configure's square sums (a power, a norm),
/// or a product of a tensor with itself (x * x: both its edges lead to the same output of the same node).
bool is_square(Node& fn, std::string const& name) {
  if (g_square_sums.count(name) != 0) return true;
  if (name != "MulBackward0") return false;
  auto const& edges = fn.next_edges();
  return edges.size() == 2 && edges[0].function && edges[0].function == edges[1].function &&
         edges[0].input_nr == edges[1].input_nr;
}

/// The addresses of the elementwise nodes (graph_configure_ancestors) that the tensor is made by: its grad_fn where
/// elementwise, and the elementwise nodes reached from it through elementwise nodes only (breadth first, `depth`
/// edges at most, `max_nodes` nodes in all). The tensor is an elementwise function of what those nodes read
/// (gact/compressor.py: _exact_read). A sum's or mean's square (graph_configure's square sums: a norm, a
/// variance; or x * x) over at least `min_span` values per sum (graph_configure_ancestors) is not passed: each square
/// is a share of the sum, which its rounding cannot make small. Over fewer (a distance over x and y, a 3-D offset) it
/// is: their quantization groups span many such sums, and a small one takes the step of the largest.
/// Whether `name` only moves or copies elements: a view (graph_configure's view names), an unsqueeze or squeeze (einsum's),
/// a copy (contiguous()), a cast.
bool moves_elements(std::string const& name) {
  return g_view_names.count(name) != 0 || name == "UnsqueezeBackward0" || name == "SqueezeBackward0" ||
         name == "SqueezeBackward1" || name == "CloneBackward0" || name == "ToCopyBackward0";
}

/// The node and output an edge's tensor comes from, past nodes that only move or copy its elements.
std::pair<Node*, std::uint32_t> source_past_views(torch::autograd::Edge const& edge) {
  Node* fn = edge.function.get();
  std::uint32_t nr = edge.input_nr;
  for (int i = 0; i < 16 && fn != nullptr && moves_elements(fn->name()); ++i) {
    auto const& next = fn->next_edges();
    if (next.empty()) break;
    nr = next[0].input_nr;
    fn = next[0].function.get();
  }
  return {fn, nr};
}

/// Whether the matrix product `node` multiplies a tensor with a view of itself (x @ x.T, a covariance or a Gram
/// matrix; einsum's and torch.cov's too) where that tensor is an activation (computed: its source is no leaf's
/// AccumulateGrad). Addmm's and baddbmm's operands are its second and third edges.
bool is_gram(Node& node) {
  auto const& edges = node.next_edges();
  std::size_t const first = node.name().rfind("Addmm", 0) == 0 || node.name().rfind("Baddbmm", 0) == 0 ? 1 : 0;
  if (edges.size() < first + 2 || !edges[first].function || !edges[first + 1].function) return false;
  auto const a = source_past_views(edges[first]);
  auto const b = source_past_views(edges[first + 1]);
  return a.first != nullptr && a == b && dynamic_cast<torch::autograd::AccumulateGrad*>(a.first) == nullptr;
}

[[maybe_unused]] int64_t as_int(int64_t v) { return v; }
[[maybe_unused]] int64_t as_int(c10::SymInt const& v) { return v.expect_int(); }

/// Whether autograd's InputMetadata shows its shape (torch 2.x; torch 1.13 keeps it private).
template <typename M, typename = void>
struct shows_shape : std::false_type {};
template <typename M>
struct shows_shape<M, std::void_t<decltype(std::declval<M const&>().shape_as_dim_vector())>> : std::true_type {};

/// The channels (dimension 1) of the tensor whose metadata `m` is, or -1 where autograd does not show them.
template <typename M>
int64_t channels_of(M const& m) {
  if constexpr (shows_shape<M>::value) {
    auto const shape = m.shape_as_dim_vector();
    return shape.size() >= 2 ? as_int(shape[1]) : -1;
  } else {
    return -1;
  }
}

/// Whether the convolution node `n` reads one input channel per output channel: groups equal to its input's channels
/// (a depthwise filter, or one over a single channel: fastMRI's SSIM window over one-channel images); where autograd
/// does not show the input's shape (torch 1.13), a grouped convolution.
bool channel_filter(Node& n) {
  auto* conv = dynamic_cast<torch::autograd::generated::ConvolutionBackward0*>(&n);
  auto const& edges = n.next_edges();
  if (conv == nullptr || edges.empty() || !edges[0].function) return false;
  int64_t const groups = as_int(conv->groups);
  try {
    int64_t const channels = channels_of(edges[0].function->input_metadata(edges[0].input_nr));
    return channels >= 0 ? channels == groups : groups > 1;
  } catch (std::exception const&) {  // (a nested tensor's shape, a symbolic size)
    return false;
  }
}

/// With `products`, the walk also ends at the matrix products (graph_configure_ancestors) it reaches, returns the Gram
/// products of an activation among them (is_gram) with the elementwise nodes it passed, and tells whether there was
/// one: the products a factorization's matrix is computed from (a covariance x @ x.T under cholesky).
std::pair<std::vector<std::uintptr_t>, bool> walk_ancestors(std::uintptr_t impl, int depth, int max_nodes,
                                                            bool products) {
  std::set<std::string> const& elementwise = g_elementwise;
  std::vector<std::uintptr_t> out;
  bool gram = false;
  std::shared_ptr<Node> const start = tensor_at(impl).grad_fn();
  if (!start) return {out, gram};
  if (products && g_products.count(start->name()) != 0) {
    if (is_gram(*start)) out.push_back(reinterpret_cast<std::uintptr_t>(start.get()));
    return {out, !out.empty()};
  }
  // A matrix product with one operand that needs no gradient is a fixed linear map of the other (a Cox model's risk
  // sets, R @ exp(h)), and so is a convolution whose fixed filter reads one input channel per output channel, with no
  // trained bias (SSIM's Gaussian window over x * x, a blur): the walk passes them as it passes a sum (not where it
  // ends at products). Not a frozen network's dense convolutions (a GAN's discriminator under requires_grad_(False)),
  // whose activations would all be kept exact behind a BCE.
  auto const linear_map = [&](Node& n, std::string const& name) {
    bool const conv = name == "ConvolutionBackward0";
    if (products || (g_products.count(name) == 0 && !conv)) return false;
    int with_grad = 0;
    for (torch::autograd::Edge const& e : n.next_edges()) with_grad += e.function ? 1 : 0;
    return with_grad == 1 && (!conv || channel_filter(n));
  };
  if (elementwise.count(start->name()) == 0 && !linear_map(*start, start->name())) return {out, gram};
  std::set<Node*> seen{start.get()};
  std::vector<std::shared_ptr<Node>> frontier{start};
  std::vector<std::shared_ptr<Node>> next;
  out.push_back(reinterpret_cast<std::uintptr_t>(start.get()));
  for (int level = 0; level < depth && !frontier.empty(); ++level) {
    next.clear();
    for (std::shared_ptr<Node> const& node : frontier) {
      bool const reduction = is_reduction(node->name());
      for (torch::autograd::Edge const& e : node->next_edges()) {
        if (!e.function || seen.size() >= static_cast<std::size_t>(max_nodes)) continue;
        std::string const name = e.function->name();
        bool const product = products && g_products.count(name) != 0;
        if (!product && ((elementwise.count(name) == 0 && !linear_map(*e.function, name)) ||
                         (reduction && is_square(*e.function, name) && spans_many(*node)))) continue;
        if (seen.insert(e.function.get()).second) {
          if (!product) {
            out.push_back(reinterpret_cast<std::uintptr_t>(e.function.get()));
            next.push_back(e.function);
          } else if (is_gram(*e.function)) {  // (a product of two tensors or of parameters: not returned)
            out.push_back(reinterpret_cast<std::uintptr_t>(e.function.get()));
            gram = true;
          }
        }
      }
    }
    frontier.swap(next);
  }
  return {out, gram};
}

std::vector<std::uintptr_t> graph_ancestors(std::uintptr_t impl, int depth, int max_nodes) {
  return walk_ancestors(impl, depth, max_nodes, false).first;
}

/// graph_ancestors's walk from the tensor at `impl` that also ends at the matrix products it reaches: the addresses of
/// the nodes it passed and of the Gram products of an activation among those products, and whether there was one.
std::pair<std::vector<std::uintptr_t>, bool> graph_products(std::uintptr_t impl, int depth, int max_nodes) {
  return walk_ancestors(impl, depth, max_nodes, true);
}

/// Whether the tensor at `impl` is, up to moves and copies of its elements (moves_elements), the magnitude of a complex
/// tensor: an AbsBackward0 node whose input is complex (the dtype of the gradient its edge carries), |S| of a spectrum.
bool graph_complex_magnitude(std::uintptr_t impl) {
  at::TensorBase const x = tensor_at(impl);
  std::shared_ptr<Node> const g = x.grad_fn();  // (held: the walk reads the nodes behind it)
  if (!g) return false;
  Node* fn = g.get();
  for (int i = 0; i < 8 && fn != nullptr && moves_elements(fn->name()); ++i) {
    auto const& next = fn->next_edges();
    fn = next.empty() ? nullptr : next.front().function.get();
  }
  if (fn == nullptr || fn->name() != "AbsBackward0" || fn->next_edges().empty()) return false;
  torch::autograd::Edge const& e = fn->next_edges().front();
  if (!e.function || e.input_nr >= e.function->num_inputs()) return false;
  return c10::isComplexType(c10::typeMetaToScalarType(e.function->input_metadata(e.input_nr).options().dtype()));
}

/// Whether the backward running on this thread keeps its graph (retain_graph, create_graph); true outside a backward
/// (a saved tensor read through grad_fn._saved_*): autograd's own answer (GraphTask::keep_graph_).
bool graph_keeps() { return torch::autograd::get_current_graph_task_keep_graph(); }

/// Whether a backward is running on this thread (autograd's current graph task has its execution info).
bool in_backward() { return torch::autograd::get_current_graph_task_exec_info() != nullptr; }

}  // namespace

void register_graph(py::module_& m) {
  m.def("graph_complex_magnitude", &graph_complex_magnitude, py::arg("tensor"),
        "Whether the tensor at TensorImpl address `tensor` is, up to moves and copies of its elements, abs() of a "
        "complex tensor (a spectrum's magnitude).");
  m.def("graph_keeps", &graph_keeps,
        "Whether the backward running on this thread keeps its graph (retain_graph=True, create_graph=True); True "
        "outside a backward. Where it does not, each node's saved tensors are released once the node has run.");
  m.def("in_backward", &in_backward,
        "Whether a backward is running on this thread; False where a saved tensor is read through grad_fn._saved_* "
        "outside one.");
  m.def("graph_node", &graph_node, py::arg("tensor"),
        "The address of the autograd node of the tensor at TensorImpl address `tensor` (0 without one).");
  m.def("graph_configure_ancestors", &graph_configure_ancestors, py::arg("elementwise"), py::arg("min_span"),
        py::arg("products"),
        "The names of the elementwise nodes graph_ancestors walks (gact/saved.py's ELEMENTWISE_NODES), the "
        "fewest values a sum of squares adds per result for the walk to stop at it, and the matrix products a walk "
        "with `products` ends at (PRODUCT_NODES), once.");
  m.def("graph_ancestors", &graph_ancestors, py::arg("tensor"), py::arg("depth"), py::arg("max_nodes"),
        "The addresses of the elementwise nodes the tensor at TensorImpl address `tensor` is made by: its grad_fn, "
        "and those reached from it through elementwise nodes, within `depth` edges and `max_nodes` nodes.");
  m.def("graph_products", &graph_products, py::arg("tensor"), py::arg("depth"), py::arg("max_nodes"),
        "graph_ancestors's walk that also ends at matrix products (PRODUCT_NODES): (the addresses of the nodes it "
        "passed and of the products it reached, whether one of them multiplies an activation with a view of "
        "itself).");
  m.def("graph_configure", &graph_configure, py::arg("view_names"), py::arg("square_sums"),
        "The names of the view nodes a chain follows and of the sums of squares a reduced operand's walk does not "
        "pass (gact/saved.py's VIEW_NODES and _SQUARE_SUMS), once before any graph_reaches.");
  m.def("graph_reaches", &graph_reaches, py::arg("operands"), py::arg("targets"), py::arg("leaf"),
        py::arg("reduced"), py::arg("chain_base"), py::arg("chain_root"), py::arg("depth"), py::arg("max_nodes"),
        "Whether an edge of the graphs of `operands` (TensorImpl addresses) leads to a target's (grad_fn, "
        "output_nr) or to the leaf's AccumulateGrad, within `depth` levels and `max_nodes` nodes (gact/saved.py "
        "_reaches).");
}

}  // namespace gact::bindings
