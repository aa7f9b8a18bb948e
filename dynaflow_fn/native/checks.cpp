// The checks df.jit makes on every call, in one pass over the call's objects each.
//
// A replayed call is admitted when its leaves match the call the plan was built for (LeafCheck), and
// replayed as captured when every resident input is still at its captured address (AddressCheck).
// Both are called with Python lists of tens to hundreds of tensors, so each is one C++ call that
// reads the tensors' TensorImpl directly: no argument conversion and no Python object per tensor.
//
// LeafCheck(example, places) remembers, for each place (group, index, attribute), what
// `example[group][index]` (or its `attribute`) holds: a tensor's Python type, dispatch keys, dtype,
// device, requires_grad, sizes and strides (its data is not read), or any other object by its exact
// type and value. Calling it with `call` says whether `call` holds the same at every place. Where a
// tensor's sizes cannot be read as integers (a nested tensor, a subclass with symbolic sizes) the
// constructor raises and the caller checks another way.
//
// AddressCheck(indices, addresses) says whether `inputs[indices[k]]` starts at `addresses[k]` for
// every k. The address is read without side effects (TensorImpl::data, which does not materialize a
// copy-on-write tensor, where Tensor.data_ptr() would).

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <memory>
#include <variant>
#include <vector>

namespace {

// A strong reference, let go of with its owner.
class Owned {
 public:
  explicit Owned(PyObject* object) : object_(Py_XNewRef(object)) {}
  static Owned steal(PyObject* object) {
    Owned owned(nullptr);
    owned.object_ = object;
    return owned;
  }
  Owned(const Owned&) = delete;
  Owned(Owned&& other) noexcept : object_(other.object_) { other.object_ = nullptr; }
  ~Owned() { Py_XDECREF(object_); }
  PyObject* get() const { return object_; }

 private:
  PyObject* object_;
};

struct TensorLayout {
  Owned type;
  c10::DispatchKeySet keys;
  caffe2::TypeMeta dtype;
  c10::Device device;
  bool requires_grad;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;

  explicit TensorLayout(PyObject* tensor)
      : TensorLayout(reinterpret_cast<PyObject*>(Py_TYPE(tensor)), THPVariable_Unpack(tensor)) {}

  TensorLayout(PyObject* python_type, const at::Tensor& tensor)
      : type(python_type),
        keys(tensor.key_set()),
        dtype(tensor.dtype()),
        device(tensor.device()),
        requires_grad(tensor.requires_grad()),
        sizes(tensor.sizes().vec()),
        strides(tensor.strides().vec()) {}

  bool matches(PyObject* object) const {
    if (reinterpret_cast<PyObject*>(Py_TYPE(object)) != type.get()) {   // the example's type: a tensor too
      return false;
    }
    const at::Tensor& tensor = THPVariable_Unpack(object);
    if (tensor.key_set() != keys || tensor.dtype() != dtype || tensor.device() != device ||
        tensor.requires_grad() != requires_grad) {
      return false;
    }
    try {
      return tensor.sizes().equals(sizes) && tensor.strides().equals(strides);
    } catch (const c10::Error&) {       // its sizes became symbolic: no match
      return false;
    }
  }
};

struct Value {
  Owned type;
  Owned value;

  explicit Value(PyObject* object) : type(reinterpret_cast<PyObject*>(Py_TYPE(object))), value(object) {}

  bool matches(PyObject* object) const {
    if (reinterpret_cast<PyObject*>(Py_TYPE(object)) != type.get()) {
      return false;
    }
    int equal = PyObject_RichCompareBool(object, value.get(), Py_EQ);
    if (equal < 0) {
      PyErr_Clear();
      return false;
    }
    return equal == 1;
  }
};

struct Place {
  Py_ssize_t group;
  Py_ssize_t index;
  Owned attribute;                      // its name, or nullptr for the object itself
  std::variant<TensorLayout, Value> expected;

  bool matches(PyObject* call) const {
    PyObject* object = item(item(call, group), index);
    if (object == nullptr) {
      return false;
    }
    if (attribute.get() == nullptr) {
      return holds(object);
    }
    Py_INCREF(object);                  // getattr may run Python code that lets go of it
    PyObject* value = PyObject_GetAttr(object, attribute.get());
    Py_DECREF(object);
    if (value == nullptr) {
      PyErr_Clear();
      return false;
    }
    bool result = holds(value);
    Py_DECREF(value);
    return result;
  }

  bool holds(PyObject* object) const {
    return std::visit([object](const auto& expected) { return expected.matches(object); }, expected);
  }

  // container[index] of a list or tuple, borrowed; nullptr for anything else or an index past its end.
  static PyObject* item(PyObject* container, Py_ssize_t index) {
    if (container == nullptr) {
      return nullptr;
    }
    if (PyList_Check(container)) {
      return index < PyList_GET_SIZE(container) ? PyList_GET_ITEM(container, index) : nullptr;
    }
    if (PyTuple_Check(container)) {
      return index < PyTuple_GET_SIZE(container) ? PyTuple_GET_ITEM(container, index) : nullptr;
    }
    return nullptr;
  }
};

// A Python object holding one check's state: what the constructor built, let go of with the object.
template <typename State>
struct Holder {
  PyObject_HEAD
  State* state;
};

template <typename State>
PyObject* hold(PyTypeObject* type, std::unique_ptr<State> state) {
  auto* self = reinterpret_cast<Holder<State>*>(type->tp_alloc(type, 0));
  if (self != nullptr) {
    self->state = state.release();
  }
  return reinterpret_cast<PyObject*>(self);
}

template <typename State>
void let_go(PyObject* self) {
  delete reinterpret_cast<Holder<State>*>(self)->state;
  Py_TYPE(self)->tp_free(self);
}

using Places = std::vector<Place>;
using Addresses = std::vector<std::pair<Py_ssize_t, uintptr_t>>;     // (index, address)

PyObject* LeafCheck_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* example;
  PyObject* places;
  if (!PyArg_ParseTuple(args, "OO!", &example, &PyList_Type, &places)) {
    return nullptr;
  }
  auto built = std::make_unique<Places>();
  try {
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(places); ++k) {
      Py_ssize_t group, index;
      PyObject* attribute;
      if (!PyArg_ParseTuple(PyList_GET_ITEM(places, k), "nnO", &group, &index, &attribute)) {
        return nullptr;
      }
      PyObject* object = Place::item(Place::item(example, group), index);
      if (object == nullptr) {
        PyErr_SetString(PyExc_IndexError, "a place the example does not hold");
        return nullptr;
      }
      bool itself = attribute == Py_None;
      Owned value = itself ? Owned(object) : Owned::steal(PyObject_GetAttr(object, attribute));
      if (value.get() == nullptr) {
        return nullptr;
      }
      Owned name(itself ? nullptr : attribute);
      if (THPVariable_Check(value.get())) {
        built->push_back(Place{group, index, std::move(name), TensorLayout(value.get())});
      } else {
        built->push_back(Place{group, index, std::move(name), Value(value.get())});
      }
    }
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_ValueError, error.what_without_backtrace());
    return nullptr;
  }
  return hold(type, std::move(built));
}

PyObject* LeafCheck_call(Holder<Places>* self, PyObject* args, PyObject* kwargs) {
  PyObject* call;
  if (!PyArg_UnpackTuple(args, "LeafCheck", 1, 1, &call)) {
    return nullptr;
  }
  for (const Place& place : *self->state) {
    if (!place.matches(call)) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

PyTypeObject LeafCheckType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* AddressCheck_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* indices;
  PyObject* addresses;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &indices, &PyList_Type, &addresses)) {
    return nullptr;
  }
  if (PyList_GET_SIZE(indices) != PyList_GET_SIZE(addresses)) {
    PyErr_SetString(PyExc_ValueError, "as many indices as addresses");
    return nullptr;
  }
  auto built = std::make_unique<Addresses>();
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(indices); ++k) {
    Py_ssize_t index = PyLong_AsSsize_t(PyList_GET_ITEM(indices, k));
    uintptr_t address = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(addresses, k));
    if (PyErr_Occurred()) {
      return nullptr;
    }
    built->emplace_back(index, address);
  }
  return hold(type, std::move(built));
}

PyObject* AddressCheck_call(Holder<Addresses>* self, PyObject* args, PyObject* kwargs) {
  PyObject* inputs;
  if (!PyArg_UnpackTuple(args, "AddressCheck", 1, 1, &inputs)) {
    return nullptr;
  }
  for (const auto& [index, address] : *self->state) {
    PyObject* object = Place::item(inputs, index);
    if (object == nullptr || !THPVariable_Check(object)) {
      Py_RETURN_FALSE;
    }
    try {
      if (reinterpret_cast<uintptr_t>(THPVariable_Unpack(object).unsafeGetTensorImpl()->data()) != address) {
        Py_RETURN_FALSE;
      }
    } catch (const c10::Error&) {       // a tensor without storage
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

PyTypeObject AddressCheckType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool ready(PyTypeObject& type, const char* name, size_t size, newfunc make, destructor dealloc,
           ternaryfunc call) {
  type.tp_name = name;
  type.tp_basicsize = static_cast<Py_ssize_t>(size);
  type.tp_flags = Py_TPFLAGS_DEFAULT;
  type.tp_new = make;
  type.tp_dealloc = dealloc;
  type.tp_call = call;
  return PyType_Ready(&type) == 0;
}

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)
#define CONCAT_(a, b) a##b
#define CONCAT(a, b) CONCAT_(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, STRINGIFY(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};

}  // namespace

PyMODINIT_FUNC CONCAT(PyInit_, TORCH_EXTENSION_NAME)() {
  if (!ready(LeafCheckType, "LeafCheck", sizeof(Holder<Places>), LeafCheck_new, let_go<Places>,
             reinterpret_cast<ternaryfunc>(LeafCheck_call)) ||
      !ready(AddressCheckType, "AddressCheck", sizeof(Holder<Addresses>), AddressCheck_new, let_go<Addresses>,
             reinterpret_cast<ternaryfunc>(AddressCheck_call))) {
    return nullptr;
  }
  PyObject* created = PyModule_Create(&module);
  if (created == nullptr) {
    return nullptr;
  }
  if (PyModule_AddObjectRef(created, "LeafCheck", reinterpret_cast<PyObject*>(&LeafCheckType)) < 0 ||
      PyModule_AddObjectRef(created, "AddressCheck", reinterpret_cast<PyObject*>(&AddressCheckType)) < 0) {
    Py_DECREF(created);
    return nullptr;
  }
  return created;
}
