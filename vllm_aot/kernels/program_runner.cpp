// A compiled program's model library called without holding Python's GIL.
//
// torch's binding of AOTInductor's runner (`torch._C._aoti.AOTIModelContainerRunnerCpu.run`)
// keeps the GIL for the whole call, so while a step runs its programs no other Python thread of
// the engine moves: under async scheduling the engine's main thread (the next step's schedule,
// the last step's outputs) waits for a gap between two programs and then stops the step while it
// runs. This is the same runner behind a binding that lets the GIL go once the inputs are taken
// and takes it back for the outputs. The program's own calls into our ops need no Python; a
// collective implemented in Python takes the GIL itself.
//
// The library is a Python extension module as well as a library of ops (`kernels/__init__.py`
// imports it as one after loading it).
#include <torch/csrc/inductor/aoti_runner/model_container_runner_cpu.h>
#include <torch/extension.h>

#include <string>
#include <vector>

namespace {

// A type of our own: torch binds the runner's class itself, and pybind11 binds a type once.
class ProgramRunner {
 public:
  explicit ProgramRunner(const std::string& library) : runner_(library, 1) {}

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) {
    return runner_.run(inputs);
  }

  std::vector<std::string> call_spec() { return runner_.get_call_spec(); }

 private:
  torch::inductor::AOTIModelContainerRunnerCpu runner_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<ProgramRunner>(m, "ProgramRunner")
      .def(pybind11::init<const std::string&>(), pybind11::arg("library"))
      .def("run", &ProgramRunner::run, pybind11::arg("inputs"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("get_call_spec", &ProgramRunner::call_spec);
}
