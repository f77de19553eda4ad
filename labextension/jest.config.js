// Unit tests of the pure modules (format.ts, state.ts): plain Node, no JupyterLab, no DOM.
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/test'],
  transform: {
    '^.+\\.tsx?$': ['ts-jest', { tsconfig: 'tsconfig.test.json' }]
  }
};
