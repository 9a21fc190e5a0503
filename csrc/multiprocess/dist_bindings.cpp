// Binding of the multi-process executors (module ringreduce._dist_C): the Comm of one rank
// (comm.h), used by ringreduce/hierarchy.py and the tests, and the torch.distributed backend
// (backend.h). Every method that may wait releases the GIL first.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "backend.h"
#include "comm.h"
#include "host_group.h"

namespace {

using rr::dist::Comm;
using rr::dist::P2PDone;

// [(id, peer, error or None)] of the operations that completed or failed.
pybind11::list p2p_progress(Comm& c, double max_wait_s) {
  std::vector<P2PDone> done;
  {
    pybind11::gil_scoped_release no_gil;
    done = c.p2p_progress(max_wait_s);
  }
  pybind11::list out;
  for (const auto& d : done) {
    pybind11::object error = d.error.empty() ? pybind11::object(pybind11::none())
                                             : pybind11::object(pybind11::str(d.error));
    out.append(pybind11::make_tuple(d.id, d.peer, error));
  }
  return out;
}

pybind11::object cuda_distinct_gpus(Comm& c) {
  int answer;
  {
    pybind11::gil_scoped_release no_gil;
    answer = c.cuda_distinct_gpus();
  }
  if (answer < 0) return pybind11::none();
  return pybind11::bool_(answer == 1);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ringreduce multi-process executors (internal; use the 'ringreduce' backend of "
            "torch.distributed)";
  pybind11::register_exception<rr::dist::CommError>(m, "CommError", PyExc_RuntimeError);
#ifdef RINGREDUCE_WITH_CUDA
  m.attr("cuda") = true;
#else
  m.attr("cuda") = false;
#endif
  m.attr("max_ranks") = rr::dist::kMaxRanks;
  pybind11::class_<Comm, std::shared_ptr<Comm>>(m, "Comm")
      .def(pybind11::init<int, int, int64_t, double, const std::string&, int64_t>(),
           pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("capacity"),
           pybind11::arg("timeout"), pybind11::arg("tag"), pybind11::arg("cuda_capacity"))
      .def_property_readonly("name", &Comm::name)
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("size", &Comm::size)
      .def_property_readonly("closed", &Comm::closed)
      .def("attach", &Comm::attach, pybind11::arg("names"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("unlink", &Comm::unlink,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("close", &Comm::close,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("abort", &Comm::abort)
      .def("fail", &Comm::fail, pybind11::arg("message"))
      .def("cuda_distinct_gpus", &cuda_distinct_gpus)
      .def("check", &Comm::check, pybind11::arg("tensor"), pybind11::arg("op"),
           pybind11::arg("fn"), pybind11::arg("arg"))
      .def("set_timeout", &Comm::set_timeout, pybind11::arg("seconds"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("all_reduce_path", &Comm::all_reduce_path, pybind11::arg("tensor"),
           pybind11::arg("op"))
      .def("all_reduce", &Comm::all_reduce, pybind11::arg("tensor"), pybind11::arg("op"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("broadcast", &Comm::broadcast, pybind11::arg("tensor"), pybind11::arg("root"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("all_gather", &Comm::all_gather, pybind11::arg("outputs"), pybind11::arg("input"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("reduce_scatter", &Comm::reduce_scatter, pybind11::arg("output"),
           pybind11::arg("input"), pybind11::arg("op"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("barrier", &Comm::barrier,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("gather", &Comm::gather, pybind11::arg("outputs"), pybind11::arg("input"),
           pybind11::arg("root"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("scatter", &Comm::scatter, pybind11::arg("output"), pybind11::arg("inputs"),
           pybind11::arg("root"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("all_to_all", &Comm::all_to_all, pybind11::arg("outputs"), pybind11::arg("inputs"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("p2p_post", &Comm::p2p_post, pybind11::arg("id"), pybind11::arg("send"),
           pybind11::arg("tensor"), pybind11::arg("peer"), pybind11::arg("tag"),
           pybind11::arg("dtype"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("p2p_progress", &p2p_progress, pybind11::arg("max_wait"))
      .def("p2p_interrupt", &Comm::p2p_interrupt);
  rr::dist::bind_backend(m);
}
